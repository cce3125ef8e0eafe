"""What an operator reads in `omnigraph serve`'s log: one format, the startup phases (the first
serve's bundle build included), request ids on access and error lines, no probe noise."""

import re

import httpx
import pytest

QUESTION = {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}
# asctime, level, logger: message
LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: .*")
STARTUP_PHASES = (r"bundle\(s\) verified in", r"reserved 1 replica\(s\) of 1 stage\(s\)",
                  r"stage 0: replica 0 on worker \d+ \(generation \d+, route [\w-]+\) loaded laya\.\w+ on "
                  r"CPUExecutionProvider, warmed up in \d+ ms; ready in",
                  r"stage\(s\) serving, started in", r"model 'laya' is ready")
FIRST_SERVE_PHASES = (r"building checkpoint into .* \(the first time only\)",
                      r"building bundle into .* \(the first time only\)", r"built .* in \d+\.\d s")


def _serve_and_read_log(start_server, env):
    server = start_server(env=env)
    for _ in range(3):
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
    answer = httpx.post(f"{server.url}/v1/systemone", json={"state": "Please refund me.", "questions": QUESTION},
                        headers={"X-Request-Id": "trace-answered-1"}, timeout=60)
    assert answer.status_code == 200 and answer.headers["X-Request-Id"] == "trace-answered-1"
    refused = httpx.post(f"{server.url}/v1/systemone", json={"state": "Please refund me."},
                         headers={"X-Request-Id": "trace-refused-2"}, timeout=60)
    assert refused.status_code == 422 and refused.json()["request_id"] == "trace-refused-2"
    server.stop()
    return server.log.read_text().splitlines()


@pytest.mark.parametrize("log_probes", ["0", "1"])
def test_one_format_startup_phases_and_probe_access_lines_only_when_asked(start_server, log_probes, tmp_path):
    # the first run serves from an empty cache, so its log also shows the demo bundle being built
    env = {"OMNIGRAPH_LOG_PROBES": log_probes, **({"OMNIGRAPH_CACHE": str(tmp_path / "cache")}
                                                    if log_probes == "0" else {})}
    lines = _serve_and_read_log(start_server, env)
    logged = [line for line in lines if LINE.fullmatch(line)]
    assert logged, "no line in the one format"
    # every line of omnigraph's and uvicorn's loggers is in the one format (a traceback's lines aside)
    assert not [line for line in lines if re.match(r"(INFO|WARNING|ERROR):\s", line)]
    text = "\n".join(logged)
    for phase in STARTUP_PHASES + (FIRST_SERVE_PHASES if log_probes == "0" else ()):
        assert re.search(phase, text), phase
    probes = re.findall(r'"GET /(health|metrics) HTTP/1\.1" 200', text)
    assert len(probes) == (6 if log_probes == "1" else 0)


def test_request_ids_on_the_access_line_and_the_error_line(start_server):
    text = "\n".join(_serve_and_read_log(start_server, {}))
    assert re.search(r'INFO uvicorn\.access: .* "POST /v1/systemone HTTP/1\.1" 200 request_id=trace-answered-1$',
                     text, re.M)
    assert re.search(r'INFO uvicorn\.access: .* "POST /v1/systemone HTTP/1\.1" 422 request_id=trace-refused-2$',
                     text, re.M)
    assert re.search(r"INFO omnigraph\.plugin\.api: request trace-refused-2: POST /v1/systemone 422 "
                     r"invalid_request: .*questions", text)
