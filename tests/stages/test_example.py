"""The examples run end to end: their own bundles, their YAML, exact outputs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_two_stage_example(tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLES / "two_stage_graph.py"), "--out", str(tmp_path),
                           "--requests", "20"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "AsyncOmni: 20/20 exact" in done.stdout and "Omni: 20/20 exact" in done.stdout
    assert (tmp_path / "two_stage_graph.yaml").is_file()
    assert (tmp_path / "bundles" / "features" / "manifest.json").is_file()


@pytest.mark.ray
@pytest.mark.slow
def test_ray_cluster_example_serves_across_three_nodes_as_the_local_backend_does(tmp_path):
    pytest.importorskip("ray")
    done = subprocess.run([sys.executable, str(EXAMPLES / "ray_cluster.py"), "--out", str(tmp_path),
                           "--requests", "100"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"nodes_used": 3, "answers": 100, "lost": 0,
                                                                "identical_to_local": True}
    assert (tmp_path / "ray_cluster.yaml").is_file()
