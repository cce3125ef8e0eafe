"""The CUDA kernels on a real GPU (BF16 and FP16, CUDA EP only, CUDA-graph replay): the self-test's
correctness cases. Runs where onnxruntime-gpu sees a CUDA device; skipped elsewhere."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from omnigraph.workers.ops import selftest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        "CUDAExecutionProvider" not in ort.get_available_providers(), reason="needs onnxruntime-gpu with a CUDA device"
    ),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_kernels_match_reference_on_the_cuda_ep(cuda_library, dtype):
    pytest.importorskip("torch")  # loads the CUDA libraries onnxruntime-gpu needs
    for case, model, feeds, expected in selftest.correctness_cases(np.random.default_rng(0), dtype):
        result = selftest.check_case(cuda_library.library_path, model, feeds, expected, dtype)
        assert result["ok"], (case, result)
