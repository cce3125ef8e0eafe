"""A script that builds a vLLM-backed Omni at import, without a main guard, is named when vLLM's
engine process (which imports the script again) cannot start."""

import sys
import types

import pytest

from omnigraph.stages.native_stage import unguarded_main_script


@pytest.mark.parametrize("source, named", [
    ('from omnigraph import Omni\nwith Omni(model="cua_s1", bundle="b") as omni:\n    pass\n', True),
    ('from omnigraph import Omni\n\nif __name__ == "__main__":\n    Omni(model="cua_s1")\n', False),
    ("import omnigraph\nif __name__=='__main__':\n    main()\n", False),
    ('x = 1\n# if __name__ == "__main__":\n', True),
])
def test_the_running_script_is_named_only_without_a_main_guard(tmp_path, monkeypatch, source, named):
    script = tmp_path / "user_script.py"
    script.write_text(source)
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert unguarded_main_script() == (str(script) if named else None)


def test_an_interactive_session_is_never_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # no __file__: a REPL or -c
    assert unguarded_main_script() is None
