"""The two-stage example runs end to end: its own bundles, its YAML, AsyncOmni and Omni, exact outputs."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "two_stage_graph.py"


def test_two_stage_example(tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLE), "--out", str(tmp_path), "--requests", "20"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "AsyncOmni: 20/20 exact" in done.stdout and "Omni: 20/20 exact" in done.stdout
    assert (tmp_path / "two_stage_graph.yaml").is_file()
    assert (tmp_path / "bundles" / "features" / "manifest.json").is_file()
