"""A user's script that builds a Cua-S1 `Omni` at import, with no `if __name__ == "__main__":`
guard, fails with an error that names the script and the guard (vLLM's engine process imports the
script again), not an empty `RuntimeError`; the same script with the guard answers."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm")

BODY = """with Omni(model="cua_s1", bundle={bundle!r}) as omni:
    [out] = omni.generate([{{"state": '- Button "OK"', "questions": {{"next": {{"type": "choice",
        "instructions": "Which button?", "criteria": {{"ok": "OK", "cancel": "Cancel"}}}}}}}}])
    print("answer", out.custom_output["answers"]["next"]["choice"])
"""


def _run(script, tmp_path):
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)


def test_an_unguarded_script_is_told_to_add_the_guard_and_a_guarded_one_answers(cua_bundle, tmp_path):
    unguarded = tmp_path / "decide.py"
    unguarded.write_text("from omnigraph import Omni\n\n" + BODY.format(bundle=str(cua_bundle.root)))
    failed = _run(unguarded, tmp_path)
    assert failed.returncode != 0
    last = failed.stderr.strip().splitlines()[-1]
    assert f"engine process imports your script {unguarded} again" in last, failed.stderr[-3000:]
    assert 'no `if __name__ == "__main__":` guard' in last

    guarded = tmp_path / "decide_guarded.py"
    indented = "".join(f"    {line}\n" for line in BODY.format(bundle=str(cua_bundle.root)).splitlines())
    guarded.write_text('from omnigraph import Omni\n\nif __name__ == "__main__":\n' + indented)
    answered = _run(guarded, tmp_path)
    assert answered.returncode == 0, answered.stderr[-3000:]
    assert {"answer ok", "answer cancel"} & set(answered.stdout.splitlines()), answered.stdout[-3000:]
