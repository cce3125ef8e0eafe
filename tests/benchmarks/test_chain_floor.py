"""benchmarks/gpu/chain_floor.cu (issue 19's floor probe): it compiles for Hopper with the project's
nvcc flags, and refuses bad arguments, or a machine with no GPU, with a clear message and a nonzero
exit before it touches the device. Its timings come from the GPU machine only
(benchmarks/gpu/chain_floor_run.sh); none is asserted here.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from omnigraph.workers.ops.build import find_nvcc

SOURCE = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "chain_floor.cu"


@pytest.fixture(scope="module")
def chain_floor(tmp_path_factory) -> Path:
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    binary = tmp_path_factory.mktemp("chain_floor") / "chain_floor"
    build = subprocess.run([str(nvcc), "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", str(SOURCE),
                            "-o", str(binary)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    return binary


def _run(binary: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args", [("--rows", "0"), ("--rows", "64,abc"), ("--launches", "0")])
def test_values_that_are_not_positive_are_refused(chain_floor, args):
    result = _run(chain_floor, *args)
    assert result.returncode == 2
    assert "--launches and every --rows value must be positive" in result.stderr


@pytest.mark.parametrize("args", [("--bogus",), ("--json",), ("--rows",)])
def test_an_unknown_or_incomplete_argument_prints_the_usage(chain_floor, args):
    result = _run(chain_floor, *args)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: chain_floor --json PATH")


def test_without_a_gpu_it_says_so_and_writes_nothing(chain_floor, tmp_path):
    if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0:
        pytest.skip("this machine has a GPU")
    result = _run(chain_floor, "--json", str(tmp_path / "rows.json"), "--rows", "64")
    assert result.returncode == 1
    assert result.stderr.startswith("cudaGetDeviceProperties: ")
    assert not (tmp_path / "rows.json").exists()
