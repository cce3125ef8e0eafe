"""Laya checkpoint -> manifest-verified ONNX bundle (component `laya.decision`).

`build_bundle` reads a checkpoint in the published layout, builds our own torch module of the
decision graph (`graph.py`), loads every weight strictly, exports it with the TorchScript ONNX
exporter (opset 17, dynamic B / L / M), replaces the traced encoder by one on ONNX Runtime's fused
operators (`ort_encoder.py`), stores all weights in one external file `weights.bin`, runs the
exported graph in ONNX Runtime against the torch module on a realistic bucket-padded
batch (`inputs.npz`) and refuses the bundle if they disagree, then packs the folder with the
tokenizer and agent config into a bundle. Everything is written in a staged folder renamed onto
`out` at the end, so a failure leaves nothing behind.

Precision (what runs in which type):
- fp32: everything in float32.
- fp16 / bf16: the weight matrices of the encoder and the head layers (projections and the
  embedding table) are *stored* in that type and cast up by a Cast node; the decision heads (type
  embedding, scorer, action head), norm weights, biases, the residual stream, norms, softmax and
  the decision features stay float32. ONNX Runtime folds the casts at session load, so every
  MatMul runs in float32 on the rounded weights (ORT CPU has no general fp16/bf16 MatMul); the
  bundle is about half the size on disk and in transit.
- fast=True (`fast_graph.py`, the custom-op library): the encoder runs on the omnigraph ops with
  its projections and activations in the precision's type (float32 for fp32, which the CPU
  kernels run; bfloat16 / float16 need the CUDA kernels), residual stream and norms in float32;
  the decision head is the fp32 export's. The library is built into the bundle.

This module imports torch: it is the `export` extra, never imported by serving code.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper
from tokenizers import Tokenizer

from omnigraph import __version__ as omnigraph_version
from omnigraph.bundles import VerifiedBundle, pack_bundle, sha256_file, staged_bundle_dir, verify_bundle
from omnigraph.bundles.cache import cached_folder
from omnigraph.pipelines.export import BundleValidationFailed, exporter_info, versioned_calibration
from omnigraph.pipelines.laya import ort_encoder
from omnigraph.pipelines.laya.graph import (
    MASKED_LOGIT,
    CheckpointInvalid,
    DecisionGraph,
    DecisionGraphConfig,
    build_decision_graph,
    load_checkpoint_weights,
    read_json,
)
from omnigraph.pipelines.laya.processor import COMPONENT
from omnigraph.pipelines.laya.sequence import OPTION_TOKEN_LIMIT, BatchLayout
from omnigraph.pipelines.laya.synth import cached_checkpoint
from omnigraph.pipelines.system_one.decoding import softmax
from omnigraph.pipelines.system_one.request import QUESTION_TYPES

logger = logging.getLogger("omnigraph.pipelines")

# Bump when the exported bytes change for the same checkpoint, so cached bundles are rebuilt.
EXPORTER_VERSION = 5
OPSET = 17
PRECISIONS = ("fp32", "fp16", "bf16")
UNPADDED_PRECISION = "fp32"
INPUT_NAMES = ("input_ids", "attention_mask", "marker_pos", "marker_mask", "qtype")
OUTPUT_NAMES = ("logits", "act_logits")
DYNAMIC_AXES = {
    "input_ids": {0: "B", 1: "L"},
    "attention_mask": {0: "B", 1: "L"},
    "marker_pos": {0: "B", 1: "M"},
    "marker_mask": {0: "B", 1: "M"},
    "qtype": {0: "B"},
    "logits": {0: "B", 1: "M"},
    "act_logits": {0: "B"},
}
GRAPH_FILE = "graph.onnx"
WEIGHTS_FILE = "weights.bin"
INPUTS_FILE = "inputs.npz"
CHECKPOINT_FILES = (
    "model.safetensors",
    "rl_agent_config.json",
    "encoder/config.json",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
)
# Bundle member <- checkpoint file (the tokenizer files flattened into the bundle root).
COPIED_FILES = {
    "tokenizer.json": "tokenizer/tokenizer.json",
    "tokenizer_config.json": "tokenizer/tokenizer_config.json",
    "rl_agent_config.json": "rl_agent_config.json",
}
FP32_LOGIT_TOLERANCE = 1e-4
REDUCED_PROBABILITY_TOLERANCE = 0.002
DECISIVE_MARGIN = 0.01
FAST_GRAPH_MODULE = "omnigraph.pipelines.laya.fast_graph"
PRECISION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
FAST_LOGIT_TOLERANCE = 1e-3  # the custom kernels' float32 rounding differs from MatMul/Softmax's
# Parameters stored in fp16 / bf16 in reduced-precision bundles (rank >= 2 only).
REDUCED_PRECISION_PREFIXES = ("encoder.", "head.")
_STORED_TYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


def build_bundle(checkpoint: Path, out: Path, *, precision: str = "fp32", fast: bool = False) -> VerifiedBundle:
    """Export the checkpoint folder `checkpoint` into the new bundle folder `out`.

    The checkpoint is read and checked completely (files, configs, every tensor's name and shape)
    before anything is written; `out` must not exist.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    checkpoint, out = Path(checkpoint), Path(out)
    if not checkpoint.is_dir():
        raise CheckpointInvalid(f"{checkpoint}: not a checkpoint folder")
    for name in CHECKPOINT_FILES:
        if not (checkpoint / name).is_file():
            raise CheckpointInvalid(f"{checkpoint}: missing checkpoint file {name}")
    if out.exists():
        raise FileExistsError(f"{out} already exists: build into a new folder")
    fast_graph = _fast_graph() if fast else None
    started = time.monotonic()
    logger.info("building a %s%s Laya bundle from %s into %s", precision, " fast" if fast else "", checkpoint, out)
    config = DecisionGraphConfig.from_checkpoint(checkpoint)
    agent_config = read_json(checkpoint / "rl_agent_config.json")
    module = build_decision_graph(config)
    load_checkpoint_weights(module, checkpoint / "model.safetensors")
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer" / "tokenizer.json"))
    layout = bundle_layout(agent_config, read_json(checkpoint / "tokenizer" / "tokenizer_config.json"),
                           tokenizer, config.encoder.pad_token_id)
    inputs = example_inputs(tokenizer, layout)
    revision = checkpoint_revision(checkpoint, agent_config)
    # The fp32 plain bundle (what CPUs run) computes no padding; the others keep shapes fixed by
    # the call's, which captured CUDA graphs and TensorRT engines need (ort_encoder's docstring).
    layout["unpadded"] = fast_graph is None and precision == UNPADDED_PRECISION

    logger.info("checkpoint read and checked (%.1f s); exporting the ONNX graph", time.monotonic() - started)
    with staged_bundle_dir(out) as staging:
        custom_ops = None
        if fast_graph is None:
            export_onnx(module, inputs, staging / GRAPH_FILE, precision, encoder_max_len=layout["max_len"],
                        unpad=layout["unpadded"])
        else:
            fast_graph.export_fast_onnx(module, inputs, staging / GRAPH_FILE, activation=PRECISION_DTYPES[precision])
            custom_ops = fast_graph.bundle_ops_library(staging)
        np.savez(staging / INPUTS_FILE, allow_pickle=False, **inputs)
        for member, source in COPIED_FILES.items():
            shutil.copyfile(checkpoint / source, staging / member)
        logger.info("graph exported (%.1f s); checking it against the checkpoint's own forward",
                    time.monotonic() - started)
        if custom_ops is None:
            validation = validate_export(module, staging / GRAPH_FILE, inputs, precision)
        elif precision == "fp32":
            validation = validate_export(module, staging / GRAPH_FILE, inputs, precision,
                                         custom_ops_library=staging / custom_ops["library_file"])
        else:
            validation = {"status": "not run at build time",
                          "reason": f"{PRECISION_DTYPES[precision]} custom ops run on CUDAExecutionProvider only; "
                                    "python -m omnigraph.workers.ops.selftest checks them on the GPU"}
        pack_bundle(
            staging,
            component=COMPONENT,
            graph_file=GRAPH_FILE,
            example_inputs_file=INPUTS_FILE,
            metadata={
                "checkpoint_revision": revision,
                "precision": precision,
                "layout": layout,
                "exporter": exporter_info(
                    "omnigraph.pipelines.laya.export", EXPORTER_VERSION, OPSET, torch=torch.__version__, fast=fast,
                    weights_dtype=PRECISION_DTYPES[precision],
                    compute_dtype=PRECISION_DTYPES[precision] if fast else "float32"),
                # The checkpoint's temperatures as shipped.
                "calibration": versioned_calibration({
                    "temperature": agent_config.get("temperature", [1.0, 1.0, 1.0]),
                    "temperature_by_options": agent_config.get("temperature_by_options", {}),
                }),
                "validation": validation,
            },
            custom_ops=custom_ops,
        )
    return verify_bundle(out)


def cached_bundle(checkpoint: Path, *, precision: str = "fp32", fast: bool = False) -> Path:
    """The bundle of `checkpoint` at this precision, built once into the cache.

    Keyed by the checkpoint's content (not its path: a cache copied elsewhere is reused), the
    variant and everything that shapes the export (exporter version, torch and onnx), so a new
    exporter never serves a bundle an older one built.
    """
    checkpoint = Path(checkpoint)
    key = {"checkpoint": checkpoint_content_sha256(checkpoint), "precision": precision, "fast": fast,
           "exporter": EXPORTER_VERSION, "torch": torch.__version__, "onnx": onnx.__version__}
    variant = f"{precision}-fast" if fast else precision
    return cached_folder("bundles", f"{checkpoint.name}-{variant}", key,
                         lambda out: build_bundle(checkpoint, out, precision=precision, fast=fast))


def default_bundle() -> Path:
    """The embedded demo: the tiny synthetic checkpoint as an fp32 bundle, built once into the cache."""
    return cached_bundle(cached_checkpoint("tiny"))


def _fast_graph() -> Any:
    """The fast-graph builder, which needs the custom-op library's sources and build tools."""
    try:
        return importlib.import_module(FAST_GRAPH_MODULE)
    except ImportError as exc:
        raise ValueError(f"fast bundles need the omnigraph custom-op library: {FAST_GRAPH_MODULE} "
                         f"cannot be imported ({exc})") from None


def bundle_layout(agent_config: dict, tokenizer_config: dict, tokenizer: Tokenizer, pad_id: int) -> dict[str, Any]:
    """metadata.layout: the I/O contract, the buckets and the limits the processor needs."""
    special = {}
    for role in ("cls", "sep", "pad", "mask"):
        token = tokenizer_config.get(f"{role}_token")
        token_id = tokenizer.token_to_id(token) if isinstance(token, str) else None
        if token_id is None:
            raise CheckpointInvalid(f"tokenizer_config.json: {role}_token {token!r} is not in tokenizer.json")
        special[f"{role}_id"] = token_id
    if special["pad_id"] != pad_id:
        raise CheckpointInvalid(f"tokenizer pad token id {special['pad_id']} differs from the encoder's "
                                f"pad_token_id {pad_id}")
    return {
        "rows": "pow2",
        # The processor's bucketing (sequence.BatchLayout): the exported graph accepts any shape,
        # buckets bound how many distinct shapes (and CUDA graphs) a server sees.
        "length_multiple": BatchLayout.length_multiple,
        "length_multiple_above_256": BatchLayout.length_multiple_above_256,
        "marker_bucket": "pow2",
        "max_len": int(agent_config.get("max_len", 512)),
        "head_max_len": int(agent_config.get("head_max_len", 192)),
        "option_tokens": OPTION_TOKEN_LIMIT,
        **special,
        "qtypes": list(QUESTION_TYPES),  # laya.common.QTYPE_NAMES order
        "option_layout": "sequential",
        "masked_logit": MASKED_LOGIT,
        "inputs": {
            "input_ids": {"dtype": "int64", "shape": ["B", "L"]},
            "attention_mask": {"dtype": "int64", "shape": ["B", "L"]},
            "marker_pos": {"dtype": "int64", "shape": ["B", "M"]},
            "marker_mask": {"dtype": "bool", "shape": ["B", "M"]},
            "qtype": {"dtype": "int64", "shape": ["B"]},
        },
        "outputs": {
            "logits": {"dtype": "float32", "shape": ["B", "M"]},
            "act_logits": {"dtype": "float32", "shape": ["B", 2]},
        },
    }


def example_inputs(tokenizer: Tokenizer, layout: dict[str, Any]) -> dict[str, np.ndarray]:
    """A realistic bucket-padded batch: choice (3 options), noul, score (5 levels) and a padding row.

    Sequences follow the Laya layout `[CLS] <type> question: ... [SEP] [MASK] opt ... [SEP] state
    [SEP]`; they exercise the graph, they are not the processor's tokenization. The padding row is
    `[CLS] [SEP]` with no marker, as the runtime pads batches to a power of two.
    """
    state = ("Please refund the duplicate charge on my last invoice. I was billed twice for the "
             "same order and the support email never answered. " * 3)
    questions = (
        ("choice", "What is the priority of this ticket?",
         ["low: can wait", "high: answer today", "urgent: answer now"]),
        ("noul", "Does the customer ask for a refund?",
         ["false: no, the statement does not hold", "true: yes, the statement holds"]),
        ("score", "How upset is the customer?",
         [f"level {i}: {text}" for i, text in enumerate(("calm", "mild", "annoyed", "angry", "furious"))]),
    )
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    rows = []
    for qtype, instructions, options in questions:
        ids = [layout["cls_id"], *encode(f"{qtype} question: {instructions}"), layout["sep_id"]]
        markers = []
        for option in options:
            markers.append(len(ids))
            ids += [layout["mask_id"], *encode(" " + option)[:layout["option_tokens"]]]
        ids.append(layout["sep_id"])
        ids = (ids + encode(state))[:layout["max_len"] - 1] + [layout["sep_id"]]
        rows.append((ids, markers, QUESTION_TYPES[qtype]))
    rows.append(([layout["cls_id"], layout["sep_id"]], [], 0))
    buckets = BatchLayout(max_len=layout["max_len"], length_multiple=layout["length_multiple"],
                          length_multiple_above_256=layout["length_multiple_above_256"])
    batch = buckets.rows_bucket(len(rows))
    length = buckets.length_bucket(max(len(ids) for ids, _, _ in rows))
    slots = buckets.markers_bucket(max(len(markers) for _, markers, _ in rows))
    inputs = {
        "input_ids": np.full((batch, length), layout["pad_id"], dtype=np.int64),
        "attention_mask": np.zeros((batch, length), dtype=np.int64),
        "marker_pos": np.zeros((batch, slots), dtype=np.int64),
        "marker_mask": np.zeros((batch, slots), dtype=bool),
        "qtype": np.zeros((batch,), dtype=np.int64),
    }
    for row, (ids, markers, qtype_index) in enumerate(rows):
        inputs["input_ids"][row, :len(ids)] = ids
        inputs["attention_mask"][row, :len(ids)] = 1
        inputs["marker_pos"][row, :len(markers)] = markers
        inputs["marker_mask"][row, :len(markers)] = True
        inputs["qtype"][row] = qtype_index
    return inputs


def export_onnx(module: DecisionGraph, inputs: dict[str, np.ndarray], graph_path: Path, precision: str,
                *, encoder_max_len: int | None = None, unpad: bool = False) -> None:
    """Trace `module` to ONNX at `graph_path`, every initializer in the one external file weights.bin.

    With `encoder_max_len`, the traced encoder is replaced by ONNX Runtime's fused operators
    (`ort_encoder.substitute_encoder`, rows of up to that many tokens; `unpad`: its token-wise work
    on real tokens only): what the plain bundles run. Without, the graph is the trace itself, which
    `fast_graph` rewrites.
    """
    args = tuple(torch.from_numpy(inputs[name]) for name in INPUT_NAMES)
    with tempfile.TemporaryDirectory(prefix="laya-export-") as scratch:
        traced = Path(scratch) / "traced.onnx"
        with torch.no_grad(), warnings.catch_warnings():
            # The TorchScript exporter is chosen on purpose (simple, robust with dynamic axes).
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            torch.onnx.export(
                module, args, str(traced),
                input_names=list(INPUT_NAMES),
                output_names=list(OUTPUT_NAMES),
                dynamic_axes=DYNAMIC_AXES,
                opset_version=OPSET,
                # Unfolded, initializers keep the checkpoint's parameter names (store_weights_as and
                # the encoder substitutions select by them); ONNX Runtime folds the weight transposes at load.
                do_constant_folding=False,
                dynamo=False,
            )
        model = onnx.load(str(traced))
    if encoder_max_len is not None:
        model = ort_encoder.substitute_encoder(model, module, max_len=encoder_max_len, unpad=unpad)
    if precision in _STORED_TYPES:
        store_weights_as(model, _STORED_TYPES[precision])
    model.graph.name = "laya_decision"
    model.producer_name = "omnigraph.pipelines.laya.export"
    model.producer_version = omnigraph_version
    onnx.save_model(model, str(graph_path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=WEIGHTS_FILE, size_threshold=0)
    (graph_path.parent / WEIGHTS_FILE).chmod(0o644)


def store_weights_as(model: onnx.ModelProto, data_type: int) -> None:
    """Store the encoder's and head layers' weight matrices as `data_type`, cast to float32 in the graph.

    The decision heads (type embedding, scorer, action head: under 1% of the weights) stay float32:
    their rounding reaches the probabilities undamped.
    """
    numpy_type = onnx.helper.tensor_dtype_to_np_dtype(data_type)
    casts = []
    for index, initializer in enumerate(model.graph.initializer):
        if (initializer.data_type != TensorProto.FLOAT or len(initializer.dims) < 2
                or not initializer.name.startswith(REDUCED_PRECISION_PREFIXES)):
            continue
        stored_name = f"{initializer.name}.stored"
        stored = numpy_helper.from_array(numpy_helper.to_array(initializer).astype(numpy_type), stored_name)
        casts.append(onnx.helper.make_node("Cast", [stored_name], [initializer.name], to=TensorProto.FLOAT,
                                           name=f"{initializer.name}.cast"))
        model.graph.initializer[index].CopyFrom(stored)
    nodes = [*casts, *model.graph.node]
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def validate_export(module: DecisionGraph, graph_path: Path, inputs: dict[str, np.ndarray], precision: str,
                    *, custom_ops_library: Path | None = None) -> dict[str, Any]:
    """Run the exported graph in ONNX Runtime (CPU) and compare with the float32 torch module.

    fp32 must match logits and act_logits within 1e-4 (1e-3 on the custom ops); fp16 / bf16 must
    keep probabilities (and the act probability) within 0.002 and every decision whose fp32
    top-two margin exceeds 0.01.
    """
    import onnxruntime as ort

    with torch.no_grad():
        expected = [t.numpy() for t in module(*(torch.from_numpy(inputs[name]) for name in INPUT_NAMES))]
    options = ort.SessionOptions()
    if custom_ops_library is not None:
        options.register_custom_ops_library(str(custom_ops_library))
    session = ort.InferenceSession(str(graph_path), options, providers=["CPUExecutionProvider"])
    actual = session.run(list(OUTPUT_NAMES), {name: inputs[name] for name in INPUT_NAMES})
    valid = inputs["marker_mask"]
    probabilities = [softmax(np.where(valid, logits, MASKED_LOGIT)) for logits in (expected[0], actual[0])]
    act_probability = [softmax(act)[:, 0] for act in (expected[1], actual[1])]
    diff = {
        "logits": float(np.abs(expected[0] - actual[0])[valid].max()),
        "act_logits": float(np.abs(expected[1] - actual[1]).max()),
        "probabilities": float(np.abs(probabilities[0] - probabilities[1])[valid].max()),
        "act_probability": float(np.abs(act_probability[0] - act_probability[1]).max()),
    }
    ranked = np.sort(np.where(valid, probabilities[0], -1.0), axis=-1)
    decisive = (valid.sum(-1) >= 2) & (ranked[:, -1] - ranked[:, -min(2, ranked.shape[1])] > DECISIVE_MARGIN)
    changed = int((decisive & (probabilities[0].argmax(-1) != probabilities[1].argmax(-1))).sum())
    if precision == "fp32":
        limit = FP32_LOGIT_TOLERANCE if custom_ops_library is None else FAST_LOGIT_TOLERANCE
        tolerance = {"logits": limit, "act_logits": limit}
    else:
        tolerance = {"probabilities": REDUCED_PROBABILITY_TOLERANCE,
                     "act_probability": REDUCED_PROBABILITY_TOLERANCE}
    failed = [f"{key} differ by {diff[key]:.3g} (tolerance {limit:g})"
              for key, limit in tolerance.items() if not diff[key] <= limit]
    if changed:
        failed.append(f"{changed} decision(s) with an fp32 top-two margin above {DECISIVE_MARGIN} changed")
    if failed:
        raise BundleValidationFailed(f"{graph_path.name} ({precision}) disagrees with the torch module: "
                                     + "; ".join(failed))
    return {
        "reference": "omnigraph.pipelines.laya.graph.DecisionGraph, torch float32",
        "runtime": f"onnxruntime {ort.__version__} CPUExecutionProvider",
        "inputs": INPUTS_FILE,
        "max_abs_diff": diff,
        "tolerance": tolerance,
        "changed_decisions": changed,
    }


def checkpoint_revision(checkpoint: Path, agent_config: dict) -> str:
    """The checkpoint's own `revision` if its config names one, else sha256 over its files."""
    revision = agent_config.get("revision")
    if isinstance(revision, str) and revision:
        return revision
    return checkpoint_content_sha256(checkpoint)


def checkpoint_content_sha256(checkpoint: Path) -> str:
    """sha256 over the checkpoint's files (name and content hash of each), wherever it lives."""
    digest = hashlib.sha256()
    for name in CHECKPOINT_FILES:
        digest.update(f"{name}\0{sha256_file(checkpoint / name)}\n".encode())
    return f"sha256:{digest.hexdigest()}"


__all__ = [
    "BundleValidationFailed",
    "CheckpointInvalid",
    "build_bundle",
    "default_bundle",
]
