"""The README's `curl` commands, run as written against the embedded demo server (only its address
is the test server's): each gets a 200 and an answer in the shape the README says. Its Python
snippet, run as written as a script."""

import ast
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("command", readme_curl_commands())
def test_a_readme_curl_command_is_answered_as_the_readme_says(demo_server, command):
    assert README_ADDRESS in command
    argv = shlex.split(command.replace(README_ADDRESS, demo_server.url.removeprefix("http://")))
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
