"""The HTTP faces of omnigraph: one FastAPI app over one pipeline (`omnigraph serve`, or vLLM's server).

Routes
  POST /v1/systemone          laya-serve's decision API: `{"model"?, "state", "questions"}` ->
                              `{"model", "answers", "usage", "audit"}`.
  POST /v1/systemone/batch    `{"model"?, "states": [1..64], "questions"}` -> `{"model", "results",
                              "total_usage", "audit"}`; each result is the single route's answer or
                              that state's own error (`{"status", "detail", "field"?}`).
  POST /v1/chat/completions   OpenAI structured outputs mapped onto decisions (`openai_schema`).
  GET  /v1/models             the served model.
  GET  /health                200 while serving or starting; 503 `{"status": "failed", "reason"}`.
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
