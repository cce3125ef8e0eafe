"""The HTTP faces of omnigraph: one FastAPI app over one pipeline (`omnigraph serve`, or vLLM's server).

Routes
  POST /v1/systemone          laya-serve's decision API: `{"model"?, "state", "questions"}` ->
                              `{"model", "answers", "usage", "audit"}`; the audit in the System One
                              schema: `model_hash`, `adapter_hash` (null when none),
                              `calibration_version`, `backend`, `precision` and, in question order,
                              `prompt_template_sha256`, `allowed_token_set_hash`, `input_tokens`.
                              `model`: a served name (`--served-model-name`), the pipeline's name,
                              or a client's own id naming no checkpoint (`jev-latest`: the served
                              model answers); a path or another installed pipeline is a 422.
  POST /v1/systemone/batch    `{"model"?, "states": [1..64], "questions"}` -> `{"model", "results",
                              "total_usage", "audit"}`; one result per state, in order: `{"id",
                              "answers", "usage", "audit"}`, or `{"id", "error": {"code", "message",
                              "field"}}` for that state alone. Admitted as a unit (503 for all).
  POST /v1/chat/completions   OpenAI structured outputs mapped onto decisions (`openai_schema`).
  GET  /v1/models             OpenAI's list, one entry per served name, each also System One's
                              `{"name", "description", "release_date", "avrik": {"hashes",
                              "backend", "limits"}}`.
  GET  /health                `{"status": "ok" | "backend_unavailable", "model_hash",
                              "calibration_version", "prompt_template_sha256", "backend",
                              "precision"}` (+ `reason` when not ok): 200 while serving or
                              starting, 503 while a stage cannot serve.
  GET  /ready                 200 once the pipeline started and its warmup request passed; 503
                              with Retry-After before.
  GET  /metrics               Prometheus: requests by route and status, latency per route and per
                              stage, queue depth, ledger capacity / reservations, disconnects.

Errors: `{"detail": ..., "field"?: ...}` on decision routes (laya-serve's shape), OpenAI's
`{"error": {"message", "type", "param", "code"}}` on OpenAI routes. 400 unusable JSON (NaN,
Infinity, duplicate keys, lone surrogates, invalid UTF-8), 413 body over 4 MiB (counted while
reading), 415 not JSON, 422 invalid request naming the field (400 on OpenAI routes), 503 not ready,
queue full (Retry-After) or failed stage, 504 past the request deadline (queueing included).
Under `omnigraph serve`, the connection itself (`connections`) answers 408 to a request head or
body that stops arriving, 431 to a head over 64 KiB and 503 when too many connections are open; a
client that hangs up is counted as a disconnect (499 in the access log and `/metrics`), not a 500.
"""
