"""Open-Jev checkpoint -> one self-contained, manifest-verified head bundle (component `open_jev.head`).

The bundle holds both stages' artifacts, so one manifest verifies everything that serves:

- `graph.onnx`: the scalar head, `hidden_states` float32 [P, H] -> `scores` float64 [P] =
  `head_w . h + b`. The checkpoint's float32 weights are stored as they are and every operand is
  cast to float64 inside the graph, so the dot product accumulates in FP64 as the model's
  contract asks (the float32 -> float64 casts are exact).
- `inputs.npz`: example `hidden_states` (deterministic, unit-variance rows);
- `backbone/`: every file of the checkpoint's backbone folder, which the native stage's vLLM loads;
- `prompt_template.json`: the checkpoint's own template when it carries one, else
  `prompt.DEFAULT_PROMPT_TEMPLATE`;
- metadata `layout` (`backbone_dir`, `hidden_size`, `max_model_len`, `head_outputs`, the graph's
  I/O) and `calibration` (the temperature and a version hashing it). `max_model_len` is the
  released loader's default prompt limit (4096 tokens, which its evaluations used), or the
  backbone's `max_position_embeddings` where that is smaller: a real Qwen backbone's 262144
  positions would size vLLM's KV cache for prompts Open-Jev never serves.

The graph is built directly with `onnx.helper` (no torch), checked against NumPy float64 on
`inputs.npz` in ONNX Runtime before packing, and everything is written in a staged folder renamed
onto `out`, so a failure leaves nothing behind. Only fp32 without the fast path exists: the head
is one dot product per prompt in float64, and the backbone's precision is vLLM's `dtype`.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from safetensors import SafetensorError
from safetensors.numpy import load_file

from omnigraph import __version__ as omnigraph_version
from omnigraph.bundles import VerifiedBundle, pack_bundle, sha256_file, staged_bundle_dir, verify_bundle
from omnigraph.bundles.cache import cached_folder
from omnigraph.bundles.onnx_graph import IR_VERSION
from omnigraph.pipelines.export import (
    BundleValidationFailed,
    exporter_info,
    validate_in_onnxruntime,
    versioned_calibration,
)
from omnigraph.pipelines.open_jev.processor import COMPONENT, HEAD_OUTPUT, PROMPT_TEMPLATE_FILE
from omnigraph.pipelines.open_jev.prompt import DEFAULT_PROMPT_TEMPLATE, PromptTemplate
from omnigraph.pipelines.open_jev.synth import BACKBONE_DIR, HEAD_FILE, TEMPERATURE_FILE, cached_checkpoint

__all__ = ["BundleValidationFailed", "CheckpointInvalid", "build_bundle", "cached_bundle", "default_bundle"]

# Bump when the exported bytes change for the same checkpoint, so cached bundles are rebuilt.
EXPORTER_VERSION = 3  # 3: graphs declare IR_VERSION
OPSET = 17
PRECISIONS = ("fp32",)
GRAPH_FILE = "graph.onnx"
INPUTS_FILE = "inputs.npz"
HEAD_INPUT = "hidden_states"
EXAMPLE_PROMPTS = 5
#: Backbone files vLLM and the processor need; any other files of the folder travel too.
BACKBONE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
#: The released Open-Jev loader's default --max-length: longer prompts are refused, not truncated.
MAX_MODEL_LEN = 4096
#: ORT's float64 dot product may sum in another order than NumPy's.
SCORE_TOLERANCE = 1e-9


class CheckpointInvalid(ValueError):
    """The checkpoint folder is not an Open-Jev checkpoint; the message names the file."""


def build_bundle(checkpoint: Path, out: Path, *, precision: str = "fp32", fast: bool = False) -> VerifiedBundle:
    """Export the checkpoint folder `checkpoint` into the new bundle folder `out`.

    The checkpoint is read and checked completely before anything is written; `out` must not exist.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"Open-Jev head bundles are fp32 only (the head accumulates in float64; the "
                         f"backbone's precision is the deploy YAML's vLLM dtype), got precision={precision!r}")
    if fast:
        raise ValueError("Open-Jev has no fast (custom-op) head: it is one float64 dot product per prompt; "
                         "build with fast=False")
    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists: build into a new folder")
    backbone_files = _backbone_files(checkpoint)
    config = _read_json(checkpoint / BACKBONE_DIR / "config.json")
    hidden_size, positions = config.get("hidden_size"), config.get("max_position_embeddings")
    for key, value in (("hidden_size", hidden_size), ("max_position_embeddings", positions)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointInvalid(f"{checkpoint / BACKBONE_DIR / 'config.json'}: {key} must be a positive "
                                    f"integer, got {value!r}")
    head_w, b = read_head(checkpoint / HEAD_FILE, hidden_size)
    temperature = read_temperature(checkpoint / TEMPERATURE_FILE)
    template_path = checkpoint / PROMPT_TEMPLATE_FILE
    template = PromptTemplate.from_file(template_path) if template_path.is_file() else DEFAULT_PROMPT_TEMPLATE
    inputs = example_inputs(hidden_size)
    revision = checkpoint_revision(checkpoint, backbone_files)

    with staged_bundle_dir(out) as staging:
        (staging / BACKBONE_DIR).mkdir()
        for name in backbone_files:
            shutil.copyfile(checkpoint / BACKBONE_DIR / name, staging / BACKBONE_DIR / name)
        onnx.save_model(head_graph(head_w, b), str(staging / GRAPH_FILE))
        np.savez(staging / INPUTS_FILE, allow_pickle=False, **inputs)
        (staging / PROMPT_TEMPLATE_FILE).write_text(template.to_json(), encoding="utf-8")
        validation = validate_in_onnxruntime(
            staging / GRAPH_FILE, inputs, {HEAD_OUTPUT: reference_scores(inputs[HEAD_INPUT], head_w, b)},
            SCORE_TOLERANCE, reference="numpy float64: hidden_states @ head_w + b", inputs_file=INPUTS_FILE)
        pack_bundle(
            staging,
            component=COMPONENT,
            graph_file=GRAPH_FILE,
            example_inputs_file=INPUTS_FILE,
            metadata={
                "checkpoint_revision": revision,
                "precision": precision,
                "layout": bundle_layout(hidden_size, min(MAX_MODEL_LEN, positions)),
                "exporter": exporter_info("omnigraph.pipelines.open_jev.export", EXPORTER_VERSION, OPSET,
                                          fast=False, weights_dtype="float32", compute_dtype="float64"),
                "calibration": versioned_calibration({"temperature": temperature}),
                "validation": validation,
            },
        )
    return verify_bundle(out)


def cached_bundle(checkpoint: Path) -> Path:
    """The bundle of `checkpoint`, built once into the cache, keyed by the checkpoint's content
    and the exporter version."""
    checkpoint = Path(checkpoint)
    revision = checkpoint_revision(checkpoint, _backbone_files(checkpoint))
    key = {"checkpoint": revision, "exporter": EXPORTER_VERSION, "onnx": onnx.__version__}
    return cached_folder("bundles", f"{checkpoint.name}-fp32", key, lambda out: build_bundle(checkpoint, out))


def default_bundle() -> Path:
    """The embedded demo: the tiny synthetic checkpoint's bundle, built once into the cache."""
    return cached_bundle(cached_checkpoint("tiny"))


def _backbone_files(checkpoint: Path) -> list[str]:
    """The backbone folder's file names (flat, no links), with the files vLLM needs present."""
    backbone = checkpoint / BACKBONE_DIR
    if not backbone.is_dir():
        raise CheckpointInvalid(f"{checkpoint}: no {BACKBONE_DIR}/ folder (the Qwen3 backbone vLLM loads)")
    names = []
    for entry in sorted(backbone.iterdir()):
        if entry.is_symlink() or not entry.is_file():
            raise CheckpointInvalid(f"{entry}: the backbone folder must hold plain files only")
        names.append(entry.name)
    missing = [name for name in BACKBONE_FILES if name not in names]
    if not any(name.endswith(".safetensors") for name in names):
        missing.append("*.safetensors")
    if missing:
        raise CheckpointInvalid(f"{backbone}: missing backbone file(s) {', '.join(missing)}")
    return names


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointInvalid(f"{path}: cannot read JSON: {exc}") from None


def read_head(path: Path, hidden_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`head_w` float32 [H] and `b` float32 [] from `head.safetensors`, nothing else in it."""
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise CheckpointInvalid(f"{path}: cannot read the scalar head: {exc}") from None
    expected = {"head_w": (hidden_size,), "b": ()}
    if set(tensors) != set(expected):
        raise CheckpointInvalid(f"{path}: the scalar head holds exactly {sorted(expected)}, got {sorted(tensors)}")
    for name, shape in expected.items():
        if tensors[name].dtype != np.float32 or tensors[name].shape != shape:
            raise CheckpointInvalid(f"{path}: {name} must be float32 {list(shape)}, got "
                                    f"{tensors[name].dtype} {list(tensors[name].shape)}")
        if not np.isfinite(tensors[name]).all():
            raise CheckpointInvalid(f"{path}: {name} holds non-finite values")
    return tensors["head_w"], tensors["b"]


def read_temperature(path: Path) -> float:
    """The checkpoint's fitted temperature: `{"temperature": T}`, T finite and positive."""
    data = _read_json(path)
    value = data.get("temperature") if isinstance(data, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CheckpointInvalid(f"{path}: must be {{\"temperature\": <finite number > 0>}}, got {data!r}")
    return float(value)


def head_graph(head_w: np.ndarray, b: np.ndarray) -> onnx.ModelProto:
    """`scores[p] = sum_i double(h[p, i]) * double(head_w[i]) + double(b)`, P symbolic."""
    hidden_size = head_w.shape[0]
    nodes = [
        helper.make_node("Cast", [HEAD_INPUT], ["hidden_states_f64"], to=TensorProto.DOUBLE, name="cast_hidden"),
        helper.make_node("Cast", ["head_w"], ["head_w_f64"], to=TensorProto.DOUBLE, name="cast_head_w"),
        helper.make_node("Cast", ["b"], ["b_f64"], to=TensorProto.DOUBLE, name="cast_b"),
        helper.make_node("MatMul", ["hidden_states_f64", "head_w_f64"], ["dot"], name="dot"),
        helper.make_node("Add", ["dot", "b_f64"], [HEAD_OUTPUT], name="add_bias"),
    ]
    graph = helper.make_graph(
        nodes, "open_jev_head",
        inputs=[helper.make_tensor_value_info(HEAD_INPUT, TensorProto.FLOAT, ["P", hidden_size])],
        outputs=[helper.make_tensor_value_info(HEAD_OUTPUT, TensorProto.DOUBLE, ["P"])],
        initializer=[numpy_helper.from_array(head_w, "head_w"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="omnigraph.pipelines.open_jev.export",
                              producer_version=omnigraph_version, ir_version=IR_VERSION)
    onnx.checker.check_model(model, full_check=True)
    return model


def example_inputs(hidden_size: int) -> dict[str, np.ndarray]:
    """`hidden_states` float32 [5, H]: deterministic unit-variance rows, like a final-norm state."""
    rng = np.random.default_rng(0)
    return {HEAD_INPUT: rng.standard_normal((EXAMPLE_PROMPTS, hidden_size), dtype=np.float32)}


def reference_scores(hidden_states: np.ndarray, head_w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The head in NumPy float64: what the graph must reproduce."""
    return hidden_states.astype(np.float64) @ head_w.astype(np.float64) + np.float64(b)


def bundle_layout(hidden_size: int, max_model_len: int) -> dict[str, Any]:
    """metadata.layout: where the backbone is, its limits, and the head graph's I/O."""
    return {
        "backbone_dir": BACKBONE_DIR,
        "hidden_size": hidden_size,
        "max_model_len": max_model_len,
        "head_outputs": [HEAD_OUTPUT],
        "prompt_template": PROMPT_TEMPLATE_FILE,
        "inputs": {HEAD_INPUT: {"dtype": "float32", "shape": ["P", hidden_size]}},
        "outputs": {HEAD_OUTPUT: {"dtype": "float64", "shape": ["P"]}},
    }


def checkpoint_revision(checkpoint: Path, backbone_files: list[str]) -> str:
    """sha256 over the checkpoint's files (names and contents), the template included when present."""
    members = [f"{BACKBONE_DIR}/{name}" for name in backbone_files] + [HEAD_FILE, TEMPERATURE_FILE]
    if (checkpoint / PROMPT_TEMPLATE_FILE).is_file():
        members.append(PROMPT_TEMPLATE_FILE)
    digest = hashlib.sha256()
    for name in members:
        digest.update(f"{name}\0{sha256_file(checkpoint / name)}\n".encode())
    return f"sha256:{digest.hexdigest()}"
