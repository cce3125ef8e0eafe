"""What an operator reads in `omnigraph serve`'s log: one format, the startup phases, no probe noise."""

import re

import httpx
import pytest

QUESTION = {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}
# asctime, level, logger: message
LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: .*")


def _serve_and_read_log(start_server, env):
    server = start_server(env=env)
    for _ in range(3):
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
    answer = httpx.post(f"{server.url}/v1/systemone", json={"state": "Please refund me.", "questions": QUESTION},
                        timeout=60)
    assert answer.status_code == 200
    server.stop()
    return server.log.read_text().splitlines()


@pytest.mark.parametrize("log_probes", ["0", "1"])
def test_one_format_startup_phases_and_probe_access_lines_only_when_asked(start_server, log_probes):
    lines = _serve_and_read_log(start_server, {"OMNIGRAPH_LOG_PROBES": log_probes})
    logged = [line for line in lines if LINE.fullmatch(line)]
    assert logged, "no line in the one format"
    # every line of omnigraph's and uvicorn's loggers is in the one format (a traceback's lines aside)
    assert not [line for line in lines if re.match(r"(INFO|WARNING|ERROR):\s", line)]
    text = "\n".join(logged)
    for phase in (r"bundle\(s\) verified in", r"replica 0 on worker \d+ .* warmed up in \d+ ms; ready in",
                  r"stage\(s\) serving, started in", r"model 'laya' is ready"):
        assert re.search(phase, text), phase
    assert re.search(r'uvicorn\.access: .* "POST /v1/systemone HTTP/1\.1" 200', text)
    probes = re.findall(r'"GET /(health|metrics) HTTP/1\.1" 200', text)
    assert len(probes) == (6 if log_probes == "1" else 0)
