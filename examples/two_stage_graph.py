"""Two graph stages from a deploy YAML: features -> head, through AsyncOmni and Omni.

    python examples/two_stage_graph.py [--out DIR] [--requests 20]

Builds two small ONNX graphs with onnx.helper, packs each into its own verified bundle under
DIR/bundles/ (DIR defaults to a temporary folder), places examples/two_stage_graph.yaml beside
them, then sends concurrent requests through `AsyncOmni` and a batch through `Omni` and checks
every output exactly against numpy. Weights and inputs are small integers, so float32 results
are exact whatever the summation order. Exits 0 only if every output matches.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from omnigraph import AsyncOmni, Omni
from omnigraph.bundles import pack_bundle

HERE = Path(__file__).resolve().parent
IN_DIM, HIDDEN, OUT_DIM = 4, 8, 3
RNG = np.random.default_rng(7)
W1 = RNG.integers(-3, 4, size=(IN_DIM, HIDDEN)).astype(np.float32)
B1 = RNG.integers(-2, 3, size=(HIDDEN,)).astype(np.float32)
W2 = RNG.integers(-3, 4, size=(HIDDEN, OUT_DIM)).astype(np.float32)
B2 = RNG.integers(-2, 3, size=(OUT_DIM,)).astype(np.float32)


def reference(x: np.ndarray) -> np.ndarray:
    """What the two stages compute together: scores = relu(x @ W1 + b1) @ W2 + b2."""
    return np.maximum(x @ W1 + B1, 0) @ W2 + B2


def _linear_graph(name: str, input_name: str, output_name: str, weight: np.ndarray, bias: np.ndarray,
                  relu: bool) -> onnx.ModelProto:
    rows, cols = weight.shape
    nodes = [helper.make_node("MatMul", [input_name, "W"], ["xw"]),
             helper.make_node("Add", ["xw", "b"], ["pre" if relu else output_name])]
    if relu:
        nodes.append(helper.make_node("Relu", ["pre"], [output_name]))
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", rows])],
        [helper.make_tensor_value_info(output_name, TensorProto.FLOAT, ["batch", cols])],
        initializer=[numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def build_bundle(folder: Path, component: str, model: onnx.ModelProto, example: dict[str, np.ndarray]) -> None:
    """Write graph.onnx and inputs.npz into `folder` and pack it into a verified bundle."""
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "graph.onnx")
    np.savez(folder / "inputs.npz", **example)
    pack_bundle(folder, component=component, example_inputs_file="inputs.npz")


def prepare(out: Path) -> Path:
    """Build both bundles under `out/bundles` and put the deploy YAML beside them."""
    example = np.ones((2, IN_DIM), np.float32)
    build_bundle(out / "bundles" / "features", "example.features",
                 _linear_graph("features", "x", "features", W1, B1, relu=True), {"x": example})
    build_bundle(out / "bundles" / "head", "example.head",
                 _linear_graph("head", "features", "scores", W2, B2, relu=False),
                 {"features": np.maximum(example @ W1 + B1, 0)})
    plan = out / "two_stage_graph.yaml"
    shutil.copyfile(HERE / "two_stage_graph.yaml", plan)
    return plan


def make_inputs(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(-5, 6, size=(int(rng.integers(1, 5)), IN_DIM)).astype(np.float32) for _ in range(count)]


async def run_async(plan: Path, inputs: list[np.ndarray]) -> int:
    """All requests at once through AsyncOmni; returns how many outputs were exact."""
    async with AsyncOmni(deploy_config=plan) as omni:
        async def one(i: int, x: np.ndarray) -> bool:
            async for output in omni.generate({"tensors": {"x": x}}, request_id=f"async-{i}"):
                return output.finished and np.array_equal(output.custom_output["scores"], reference(x))
            return False

        results = await asyncio.gather(*(one(i, x) for i, x in enumerate(inputs)))
        print(f"AsyncOmni: {sum(results)}/{len(inputs)} exact; queue depth after: {omni.queue_depth()}")
        return sum(results)


def run_sync(plan: Path, inputs: list[np.ndarray]) -> int:
    """The same requests as one list through Omni."""
    with Omni(deploy_config=plan) as omni:
        outputs = omni.generate([{"tensors": {"x": x}} for x in inputs])
        exact = sum(o.error is None and np.array_equal(o.custom_output["scores"], reference(x))
                    for o, x in zip(outputs, inputs))
        plan_info = omni.execution_plan
        print(f"Omni: {exact}/{len(inputs)} exact; stages "
              + ", ".join(f"{s['stage_id']}:{s['model_stage']} ({s['manifest']['sha256'][:12]})" for s in plan_info["stages"]))
        return exact


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where to build the bundles (default: a temporary folder)")
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="two-stage-") as scratch:
        plan = prepare(args.out or Path(scratch))
        inputs = make_inputs(args.requests)
        exact = asyncio.run(run_async(plan, inputs)) + run_sync(plan, inputs)
    ok = exact == 2 * len(inputs)
    print("all outputs exact" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
