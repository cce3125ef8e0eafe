"""Fixtures for the op-library tests: the library built once per test session (and cached across
sessions under $OMNIGRAPH_CACHE), CPU sessions over one-op graphs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from omnigraph.workers.ops.build import BuiltLibrary, build_library, find_nvcc

requires_nvcc = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")


@pytest.fixture(scope="session")
def cpu_library(tmp_path_factory: pytest.TempPathFactory) -> BuiltLibrary:
    """The CPU-only build (C++ compiler, no CUDA)."""
    return build_library(tmp_path_factory.mktemp("ops-cpu"), cuda=False)


@pytest.fixture(scope="session")
def cuda_library(tmp_path_factory: pytest.TempPathFactory) -> BuiltLibrary:
    """The nvcc build (CPU and CUDA kernels in one file); skipped where nvcc is absent."""
    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    return build_library(tmp_path_factory.mktemp("ops-cuda"), arch="90a", cuda=True)


RunGraph = Callable[..., list[np.ndarray]]


@pytest.fixture
def run_cpu(cpu_library: BuiltLibrary) -> RunGraph:
    """run_cpu(model, **feeds) -> outputs, on the CPU EP with the library registered."""

    def run(model: onnx.ModelProto, library: Path = cpu_library.library_path, **feeds: np.ndarray) -> list[np.ndarray]:
        options = ort.SessionOptions()
        options.register_custom_ops_library(str(library))
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return session.run(None, feeds)

    return run
