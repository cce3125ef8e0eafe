"""GPU self-test of the op library: correctness, placement, CUDA-graph capture and timings.

Run on a machine with a CUDA GPU and onnxruntime-gpu (torch is used for device buffers and must be
importable, which also loads the CUDA libraries ORT needs):

    python -m omnigraph.workers.ops.selftest --json results.json [--library PATH]

For each op in BF16 and FP16 it checks the CUDA kernel against the NumPy reference (inputs rounded
to the activation type first) with `session.disable_cpu_ep_fallback=1`, reads ORT's profile to
confirm every node ran on the CUDA EP, replays a captured CUDA graph and compares it with the plain
run, then times each kernel at Laya-full shapes (B=1, L=64/176/512, d=1024, 16 heads, F=2624) as
CUDA-graph replays. Rows follow benchmarks/ conventions (case, metric, value, unit, ...).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from omnigraph.bundles.hashing import sha256_file
from omnigraph.workers.ops import graphs, reference
from omnigraph.workers.placement import placement_from_profile

_TOLERANCE = {"bfloat16": 2e-2, "float16": 4e-3}  # max |error| / max(1, max |reference|)
_CUDA_PROVIDER = "CUDAExecutionProvider"
_ONNX_TYPE = {"bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16}


def _round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """x as the Cast node will see it: float32 rounded to bfloat16 / float16 (nearest even)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return rounded.view(np.float32)


def _session_options(library: Path, *, profile_dir: Path | None = None, cuda_graph: bool = False):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if profile_dir is not None:
        options.enable_profiling = True
        options.profile_file_prefix = str(profile_dir / "profile")
    return options, [(_CUDA_PROVIDER, {"enable_cuda_graph": "1" if cuda_graph else "0"})]


def check_case(
    library: Path, model: onnx.ModelProto, feeds: dict[str, np.ndarray], expected: list[np.ndarray], dtype: str
) -> dict:
    """Runs `model` on the CUDA EP (no CPU fallback), compares with `expected`, checks placement,
    and replays it as a CUDA graph."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options, providers = _session_options(library, profile_dir=Path(tmp))
        session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
        outputs = session.run(None, feeds)
        placement = placement_from_profile(session.end_profiling(), _CUDA_PROVIDER)
    errors = [
        float(np.max(np.abs(out - ref)) / max(1.0, float(np.max(np.abs(ref))))) for out, ref in zip(outputs, expected)
    ]
    off_cuda = placement.off_target_nodes()

    options, providers = _session_options(library, cuda_graph=True)
    graph_session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
    binding = graph_session.io_binding()
    device_inputs = {name: ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0) for name, value in feeds.items()}
    device_outputs = [
        ort.OrtValue.ortvalue_from_shape_and_type(list(out.shape), np.float32, "cuda", 0) for out in outputs
    ]
    for name, value in device_inputs.items():
        binding.bind_ortvalue_input(name, value)
    for meta, value in zip(graph_session.get_outputs(), device_outputs):
        binding.bind_ortvalue_output(meta.name, value)
    for _ in range(3):  # the first run captures, the rest replay
        graph_session.run_with_iobinding(binding)
    replayed = [value.numpy() for value in device_outputs]
    graph_mismatch = max(float(np.max(np.abs(a - b))) for a, b in zip(replayed, outputs))
    return {
        "max_relative_error": max(errors),
        "tolerance": _TOLERANCE[dtype],
        "nodes": len(placement.node_providers),
        "nodes_off_cuda": off_cuda,
        "cuda_graph_max_abs_diff": graph_mismatch,
        "ok": (max(errors) <= _TOLERANCE[dtype] and not off_cuda and len(placement.node_providers) > 0
               and graph_mismatch == 0.0),
    }


def correctness_cases(rng: np.random.Generator, dtype: str) -> list[tuple[str, onnx.ModelProto, dict, list]]:
    """(case, model, float32 feeds, reference outputs) for every op, with padding and windows."""
    cases = []
    # (head dim, window, length, padded keys at the end of the second row); the last case pads that
    # row completely, so its queries see no key at all.
    for head_dim, window, length, padded in (
        (64, 0, 176, 58), (64, 64, 176, 58), (32, 3, 45, 15), (128, 0, 33, 11), (64, 64, 512, 170),
        (64, 0, 64, 21), (64, 16, 200, 200),
    ):  # fmt: skip
        heads = 4
        qkv = _round_to(rng.standard_normal((2, length, 3 * heads * head_dim)), dtype)
        mask = np.ones((2, length), dtype=np.int64)
        mask[1, length - padded :] = 0
        expected = reference.modernbert_attention(qkv, mask, num_heads=heads, rope_theta=160000.0, window=window)
        model = graphs.attention_model(num_heads=heads, rope_theta=160000.0, window=window, dtype=dtype)
        cases.append((f"attention_D{head_dim}_w{window}_L{length}", model, {"qkv": qkv, "key_mask": mask}, [expected]))
    x = _round_to(rng.standard_normal((37, 2 * 2624)) * 2, dtype)
    cases.append(("geglu_F2624", graphs.geglu_model(dtype=dtype), {"x": x}, [reference.geglu(x)]))
    residual = rng.standard_normal((37, 1024)).astype(np.float32) * 3
    x = _round_to(rng.standard_normal((37, 1024)), dtype)
    weight = rng.standard_normal(1024).astype(np.float32)
    cases.append(
        (
            "add_layer_norm_d1024",
            graphs.add_layer_norm_model(dtype=dtype),
            {"residual": residual, "x": x, "weight": weight},
            list(reference.add_layer_norm(residual, x, weight)),
        )
    )
    return cases


def _replicated(make_node: Callable[[int], onnx.NodeProto], inputs: list, outputs: Callable[[int], list], copies: int):
    """A graph of `copies` independent copies of one node over shared inputs (for timing)."""
    nodes = [make_node(i) for i in range(copies)]
    graph_outputs = [value for i in range(copies) for value in outputs(i)]
    graph = helper.make_graph(nodes, "timing", inputs, graph_outputs)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(graphs.DOMAIN, graphs.OPSET)],
        ir_version=9,
    )


def _timing_models(length: int, copies: int, dtype: str) -> dict[str, tuple[onnx.ModelProto, dict, dict]]:
    """case -> (model, input shapes and types, output shapes and types) at Laya-full shapes."""
    d, heads, features = 1024, 16, 2624
    t = _ONNX_TYPE[dtype]
    models = {}
    for window in (0, 64):
        def attention(i: int, w: int = window) -> onnx.NodeProto:
            return helper.make_node(
                "ModernBertAttention", ["qkv", "key_mask"], [f"context{i}"], name=f"attention{i}",
                domain=graphs.DOMAIN,
                num_heads=heads, window=w, rope_theta=160000.0 if w == 0 else 10000.0,
            )

        models[f"attention_L{length}_w{window}"] = (
            _replicated(
                attention,
                [
                    helper.make_tensor_value_info("qkv", t, [1, length, 3 * d]),
                    helper.make_tensor_value_info("key_mask", TensorProto.INT64, [1, length]),
                ],
                lambda i: [helper.make_tensor_value_info(f"context{i}", t, [1, length, d])],
                copies,
            ),
            {"qkv": ([1, length, 3 * d], t), "key_mask": ([1, length], TensorProto.INT64)},
            {f"context{i}": ([1, length, d], t) for i in range(copies)},
        )
    models[f"geglu_L{length}"] = (
        _replicated(
            lambda i: helper.make_node("GeGLU", ["x"], [f"y{i}"], name=f"geglu{i}", domain=graphs.DOMAIN),
            [helper.make_tensor_value_info("x", t, [1, length, 2 * features])],
            lambda i: [helper.make_tensor_value_info(f"y{i}", t, [1, length, features])],
            copies,
        ),
        {"x": ([1, length, 2 * features], t)},
        {f"y{i}": ([1, length, features], t) for i in range(copies)},
    )
    models[f"add_layer_norm_L{length}"] = (
        _replicated(
            lambda i: helper.make_node(
                "AddLayerNorm", ["residual", "x", "weight"], [f"r{i}", f"n{i}"], name=f"norm{i}", domain=graphs.DOMAIN
            ),
            [
                helper.make_tensor_value_info("residual", TensorProto.FLOAT, [1, length, d]),
                helper.make_tensor_value_info("x", t, [1, length, d]),
                helper.make_tensor_value_info("weight", TensorProto.FLOAT, [d]),
            ],
            lambda i: [
                helper.make_tensor_value_info(f"r{i}", TensorProto.FLOAT, [1, length, d]),
                helper.make_tensor_value_info(f"n{i}", t, [1, length, d]),
            ],
            copies,
        ),
        {"residual": ([1, length, d], TensorProto.FLOAT), "x": ([1, length, d], t), "weight": ([d], TensorProto.FLOAT)},
        {
            **{f"r{i}": ([1, length, d], TensorProto.FLOAT) for i in range(copies)},
            **{f"n{i}": ([1, length, d], t) for i in range(copies)},
        },
    )
    return models


def _replay_seconds(library: Path, model: onnx.ModelProto, inputs: dict, outputs: dict, iterations: int) -> float:
    """Mean seconds of one CUDA-graph replay of `model`, buffers owned by torch."""
    import onnxruntime as ort
    import torch

    torch_type = {TensorProto.BFLOAT16: torch.bfloat16, TensorProto.FLOAT16: torch.float16,
                  TensorProto.FLOAT: torch.float32, TensorProto.INT64: torch.int64}  # fmt: skip
    options, providers = _session_options(library, cuda_graph=True)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
    binding = session.io_binding()
    keep = []
    for name, (shape, elem) in inputs.items():
        if elem == TensorProto.INT64:
            tensor = torch.ones(shape, dtype=torch.int64, device="cuda")
        else:
            tensor = torch.randn(shape, device="cuda").to(torch_type[elem])
        keep.append(tensor)
        binding.bind_input(name, "cuda", 0, elem, shape, tensor.data_ptr())
    for name, (shape, elem) in outputs.items():
        tensor = torch.empty(shape, dtype=torch_type[elem], device="cuda")
        keep.append(tensor)
        binding.bind_output(name, "cuda", 0, elem, shape, tensor.data_ptr())
    for _ in range(5):
        session.run_with_iobinding(binding)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iterations):
        session.run_with_iobinding(binding)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iterations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write the result rows here")
    parser.add_argument("--library", help="a built library (default: build one with nvcc for --arch)")
    parser.add_argument("--arch", default="90a")
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--copies", type=int, default=8, help="op copies per timing graph (launch cost cancels)")
    args = parser.parse_args(argv)

    import torch  # loads the CUDA libraries onnxruntime-gpu needs
    # isort: split
    import onnxruntime as ort

    if args.library:
        library = Path(args.library)
    else:
        from omnigraph.workers.ops.build import build_library

        library = build_library(Path(tempfile.mkdtemp(prefix="omnigraph-ops-")), arch=args.arch, cuda=True).library_path
    identity = {
        "gpu": torch.cuda.get_device_name(0),
        "onnxruntime": ort.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m omnigraph.workers.ops.selftest", *(sys.argv[1:] if argv is None else argv)]),
        "library_sha256": sha256_file(library),  # which kernels these rows measure
    }
    rows, failures = [], 0
    rng = np.random.default_rng(0)
    for dtype in ("bfloat16", "float16"):
        for case, model, feeds, expected in correctness_cases(rng, dtype):
            try:
                result = check_case(library, model, feeds, expected, dtype)
            except Exception as exc:  # a failing case is a result to report, not the end of the run
                result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            failures += not result["ok"]
            rows.append({"case": f"{case}_{dtype}", "metric": "check", "value": result.get("max_relative_error"),
                         "unit": "relative max error", **result, **identity})  # fmt: skip
            print(f"{case:<32} {dtype:<9} {'ok' if result['ok'] else 'FAIL'} {result}", flush=True)
    dtype = "bfloat16"  # the Hopper fast path's type
    for length in (64, 176, 512):
        many_copies = _timing_models(length, args.copies, dtype)
        for case, (model_1, inputs, outputs_1) in _timing_models(length, 1, dtype).items():
            model_n, _, outputs_n = many_copies[case]
            single = _replay_seconds(library, model_1, inputs, outputs_1, args.iterations)
            many = _replay_seconds(library, model_n, inputs, outputs_n, args.iterations)
            per_kernel = (many - single) / (args.copies - 1)
            for metric, value in (("graph_replay", single), ("kernel", per_kernel)):
                rows.append({"case": f"{case}_{dtype}", "metric": metric, "value": round(value * 1e6, 2),
                             "unit": "us", "copies": args.copies, "iterations": args.iterations,
                             **identity})
            print(f"{case:<28} {dtype:<9} replay {single * 1e6:8.1f} us  kernel {per_kernel * 1e6:8.1f} us",
                  flush=True)
    Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"{failures} failing checks; rows written to {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
