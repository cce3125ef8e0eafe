"""benchmarks/soak.py, briefly: 4 clients for 5 s with a worker SIGKILLed every 2 s and hang-ups.

The soak is a script, not part of the package: it is run as a command, as a user would run it, and
its JSON rows are read back. Nothing about timing is asserted, only that no request was lost,
duplicated or answered wrong, that the kills happened, and that nothing was left after the exit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


@pytest.mark.slow
def test_a_short_soak_with_worker_kills_loses_nothing(tmp_path: Path) -> None:
    rows_file = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "5", "--clients", "4", "--kill-every", "2",
                          "--hangup-fraction", "0.05", "--requests", "8", "--json", str(rows_file)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert rows_file.exists(), run.stdout + run.stderr
    rows = {(row["case"], row["metric"]): row["value"] for row in json.loads(rows_file.read_text())}
    assert rows["load", "lost"] == 0, run.stdout
    assert rows["load", "duplicated"] == 0, run.stdout
    assert rows["load", "wrong"] == 0, run.stdout
    assert rows["load", "answered"] > 0, run.stdout
    assert rows["faults", "worker_kills"] >= 1, run.stdout
    assert rows["after", "good_request_answered"] == 1, run.stdout
    assert rows["exit", "worker_processes_left"] == 0, run.stdout
    assert rows["exit", "worker_folders_left"] == 0, run.stdout
    assert run.returncode == 0, run.stdout + run.stderr
