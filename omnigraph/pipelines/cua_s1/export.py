"""Cua-S1 checkpoint -> one self-contained, manifest-verified head bundle (component ``cua_s1.head``).

``build_bundle`` reads a checkpoint in the layout ``synth.py`` describes (``base/`` backbone +
``text/`` PEFT LoRA), checks all of it, then writes into a staged folder:

- ``backbone/``: the folder vLLM loads for stage 0: the base's config, tokenizer and generation
  config as shipped and ``model.safetensors`` with the LoRA merged in: for every adapted module
  ``W += scaling * (B @ A)`` in float32, ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with
  rsLoRA), which is what PEFT's ``merge_and_unload`` computes;
- ``graph.onnx``: the letter head, ``hidden_states`` float32 [P, H] -> ``letter_logits`` float32
  [P, 26] = ``hidden_states @ lm_head[letter_token_id(A..Z)]^T``, one MatMul on the output
  projection's letter rows (the embedding rows when the base ties them), kept float32;
- ``inputs.npz`` (example ``hidden_states``), ``prompt_template.json`` (the prompt as data: the
  checkpoint's own ``prompt_template.json`` when it carries one, else the documented defaults,
  with the base's chat template and special tokens);

runs the head in ONNX Runtime against NumPy on the example, and packs the folder, so every file,
the backbone's included, is hashed in the manifest. A failure leaves nothing behind.

The base is read as a causal-LM checkpoint (top-level ``hidden_size``, ``model.layers.*`` tensors
as the adapter names them). The published Qwen3.5-4B base is the multimodal
``Qwen3_5ForConditionalGeneration`` (``text_config``, ``model.language_model.*``, tied
embeddings): its text tower has to be written out as a causal LM first; this exporter refuses it
by name rather than guess.
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
from safetensors import safe_open
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from omnigraph import __version__ as omnigraph_version
from omnigraph.bundles import VerifiedBundle, pack_bundle, sha256_file, staged_bundle_dir, verify_bundle
from omnigraph.bundles.cache import cached_folder
from omnigraph.bundles.onnx_graph import IR_VERSION
from omnigraph.pipelines.cua_s1.processor import COMPONENT, INPUT_NAME, OUTPUT_NAME
from omnigraph.pipelines.cua_s1.prompt import (
    DEFAULT_OPTION_LINE,
    DEFAULT_SYSTEM_MESSAGE,
    DEFAULT_USER_MESSAGE,
    LETTERS,
    PROMPT_TEMPLATE_FORMAT,
    SPECIAL_TOKEN_KEYS,
    PromptTemplate,
    letter_token_ids,
)
from omnigraph.pipelines.cua_s1.synth import ADAPTER_DIR, BASE_DIR, cached_checkpoint
from omnigraph.pipelines.export import (
    BundleValidationFailed,
    exporter_info,
    validate_in_onnxruntime,
    versioned_calibration,
)

__all__ = [
    "CheckpointInvalid",
    "BundleValidationFailed",
    "build_bundle",
    "cached_bundle",
    "default_bundle",
    "merge_lora",
]

# Bump when the exported bytes change for the same checkpoint, so cached bundles are rebuilt.
EXPORTER_VERSION = 2  # 2: graphs declare IR_VERSION
OPSET = 17
PRECISIONS = ("fp32",)
GRAPH_FILE = "graph.onnx"
INPUTS_FILE = "inputs.npz"
PROMPT_TEMPLATE_FILE = "prompt_template.json"
BACKBONE_DIR = "backbone"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# Backbone files copied as shipped when present (the weights are rewritten, merged, as one file).
BACKBONE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                  "generation_config.json")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
CHECKPOINT_PROMPT_KEYS = ("system_message", "user_message", "option_line")
HEAD_TOLERANCE = 1e-4
EXAMPLE_ROWS = 3
# adapter_config.json values this exporter merges; anything else is refused rather than approximated.
_ADAPTER_REQUIRED = {"peft_type": "LORA", "bias": "none", "fan_in_fan_out": False, "use_dora": False}
_ADAPTER_EMPTY = ("alpha_pattern", "rank_pattern", "modules_to_save")
_LORA_PREFIX = "base_model.model."


class CheckpointInvalid(ValueError):
    """A Cua-S1 checkpoint file is missing or inconsistent; nothing was written."""


def build_bundle(checkpoint: Path, out: Path, *, precision: str = "fp32", fast: bool = False) -> VerifiedBundle:
    """Export the Cua-S1 checkpoint folder `checkpoint` into the new bundle folder `out`.

    Only ``precision="fp32"`` and ``fast=False`` exist: the head is one float32 MatMul and the
    backbone's precision is vLLM's ``dtype`` at serving time.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} for Cua-S1 (the letter head is "
                         f"float32; choose the backbone's dtype in the deploy YAML), got {precision!r}")
    if fast:
        raise ValueError("fast=True is not available for Cua-S1: its head is a single MatMul with no "
                         "custom-op variant")
    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists():
        raise FileExistsError(f"{out} already exists: build into a new folder")
    base, adapter = checkpoint / BASE_DIR, checkpoint / ADAPTER_DIR
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        _require_file(base / name, checkpoint)
    for name in ADAPTER_FILES:
        _require_file(adapter / name, checkpoint)
    config = _read_json(base / "config.json")
    weights = load_weights(base)
    merged, lora = merge_lora(weights, adapter)
    hidden_size = _positive_int(config, "hidden_size", base)
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    try:
        letter_ids = letter_token_ids(tokenizer)
    except ValueError as exc:
        raise CheckpointInvalid(f"{base / 'tokenizer.json'}: {exc}") from None
    head = letter_rows(merged, config, letter_ids, base)
    template = prompt_template(checkpoint)
    example = {INPUT_NAME: np.random.default_rng(0).standard_normal((EXAMPLE_ROWS, hidden_size), dtype=np.float32)}
    layout = {
        "backbone_dir": BACKBONE_DIR,
        "hidden_size": hidden_size,
        "max_model_len": _positive_int(config, "max_position_embeddings", base),
        "head_outputs": [OUTPUT_NAME],
        "letters": LETTERS,
        "letter_token_ids": letter_ids,
        "prompt_template_file": PROMPT_TEMPLATE_FILE,
        "prompts_per_question": 1,
        "inputs": {INPUT_NAME: {"dtype": "float32", "shape": ["P", hidden_size]}},
        "outputs": {OUTPUT_NAME: {"dtype": "float32", "shape": ["P", len(LETTERS)]}},
        "lora": lora,
    }

    with staged_bundle_dir(out) as staging:
        backbone = staging / BACKBONE_DIR
        backbone.mkdir()
        for name in BACKBONE_FILES:
            if (base / name).is_file():
                shutil.copyfile(base / name, backbone / name)
        save_file(merged, str(backbone / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / PROMPT_TEMPLATE_FILE).write_text(template.to_json(), encoding="utf-8")
        onnx.save_model(head_graph(head), str(staging / GRAPH_FILE))
        np.savez(staging / INPUTS_FILE, allow_pickle=False, **example)
        validation = validate_in_onnxruntime(
            staging / GRAPH_FILE, example, {OUTPUT_NAME: reference_letter_logits(example[INPUT_NAME], head)},
            HEAD_TOLERANCE, reference="numpy float64 hidden_states @ letter_rows.T", inputs_file=INPUTS_FILE)
        pack_bundle(
            staging,
            component=COMPONENT,
            graph_file=GRAPH_FILE,
            example_inputs_file=INPUTS_FILE,
            metadata={
                "checkpoint_revision": checkpoint_revision(checkpoint),
                "precision": precision,
                "layout": layout,
                "exporter": exporter_info("omnigraph.pipelines.cua_s1.export", EXPORTER_VERSION, OPSET,
                                          prompt_template_format=PROMPT_TEMPLATE_FORMAT, fast=False,
                                          weights_dtype="float32"),
                # Cua-S1's softmax is untempered (T = 1), versioned like Laya's temperatures.
                "calibration": versioned_calibration({"temperature": 1.0}),
                "validation": validation,
            },
        )
    return verify_bundle(out)


def _require_file(path: Path, checkpoint: Path) -> None:
    if not path.is_file():
        raise CheckpointInvalid(f"{checkpoint}: missing checkpoint file {path.relative_to(checkpoint)}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointInvalid(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointInvalid(f"{path}: must hold a JSON object")
    return data


def _positive_int(config: dict[str, Any], key: str, where: Path) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointInvalid(f"{where / 'config.json'}: {key} must be a positive integer, got {value!r}")
    return value


def _float32_tensors(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file as float32 arrays (through torch, which reads bf16 where NumPy cannot)."""
    with safe_open(str(path), "pt") as handle:
        return {name: handle.get_tensor(name).float().numpy() for name in handle.keys()}  # noqa: SIM118 (a safe_open handle, not a dict)


def load_weights(base: Path) -> dict[str, np.ndarray]:
    """The backbone's tensors as float32: ``model.safetensors``, or the shards its index names."""
    if (base / WEIGHTS_FILE).is_file():
        return _float32_tensors(base / WEIGHTS_FILE)
    if not (base / WEIGHTS_INDEX_FILE).is_file():
        raise CheckpointInvalid(f"{base}: missing {WEIGHTS_FILE} (or {WEIGHTS_INDEX_FILE} and its shards)")
    weight_map = _read_json(base / WEIGHTS_INDEX_FILE).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointInvalid(f"{base / WEIGHTS_INDEX_FILE}: weight_map must be a non-empty object")
    weights: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        if not isinstance(shard, str) or "/" in shard or not (base / shard).is_file():
            raise CheckpointInvalid(f"{base / WEIGHTS_INDEX_FILE}: shard {shard!r} is not a file beside it")
        weights.update(_float32_tensors(base / shard))
    return weights


def _positive_number(adapter_config: dict[str, Any], key: str, where: Path) -> float:
    value = adapter_config.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise CheckpointInvalid(f"{where}: {key} must be a positive number, got {value!r}")
    return value


def lora_scaling(adapter_config: dict[str, Any], where: Path) -> float:
    """PEFT's ``scaling``: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA; other
    adapter features this merge does not implement are refused."""
    for key, expected in _ADAPTER_REQUIRED.items():
        if adapter_config.get(key, expected) != expected:
            raise CheckpointInvalid(f"{where}: {key}={adapter_config[key]!r} is not supported (needs {expected!r})")
    for key in _ADAPTER_EMPTY:
        if adapter_config.get(key):
            raise CheckpointInvalid(f"{where}: {key} is not supported (must be empty)")
    rank, alpha = _positive_number(adapter_config, "r", where), _positive_number(adapter_config, "lora_alpha", where)
    return alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank


def merge_lora(weights: dict[str, np.ndarray], adapter: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """`weights` (float32) with the adapter folder's LoRA merged in, and a summary for the manifest.

    Every ``base_model.model.<module>.lora_A.weight`` [r, in] must pair with its ``lora_B.weight``
    [out, r] and adapt a base tensor ``<module>.weight`` [out, in]; the sum is float32
    ``W + (B @ A) * scaling``, PEFT's ``get_delta_weight`` order. `weights` is not modified.
    """
    config_path = adapter / "adapter_config.json"
    adapter_config = _read_json(config_path)
    scaling = lora_scaling(adapter_config, config_path)
    rank = adapter_config["r"]
    tensors_path = adapter / "adapter_model.safetensors"
    lora = _float32_tensors(tensors_path)
    modules = sorted({name.rsplit(".lora_", 1)[0] for name in lora})
    expected = {f"{module}.lora_{side}.weight" for module in modules for side in "AB"}
    if set(lora) != expected:
        stray = sorted(set(lora) ^ expected)[0]
        raise CheckpointInvalid(f"{tensors_path}: {stray} breaks the lora_A / lora_B pairs")
    merged = dict(weights)
    for module in modules:
        if not module.startswith(_LORA_PREFIX):
            raise CheckpointInvalid(f"{tensors_path}: {module} does not start with {_LORA_PREFIX!r}")
        target = f"{module[len(_LORA_PREFIX):]}.weight"
        if target not in weights:
            raise CheckpointInvalid(f"{tensors_path}: {module} adapts {target}, which the base does not have")
        lora_a, lora_b = lora[f"{module}.lora_A.weight"], lora[f"{module}.lora_B.weight"]
        out_features, in_features = weights[target].shape
        if lora_a.shape != (rank, in_features) or lora_b.shape != (out_features, rank):
            raise CheckpointInvalid(f"{tensors_path}: {module} has A {lora_a.shape} and B {lora_b.shape}; "
                                    f"{target} {weights[target].shape} with r={rank} needs A {(rank, in_features)} "
                                    f"and B {(out_features, rank)}")
        merged[target] = weights[target] + (lora_b @ lora_a) * np.float32(scaling)
    summary = {"adapter": ADAPTER_DIR, "r": rank, "lora_alpha": adapter_config["lora_alpha"],
               "use_rslora": bool(adapter_config.get("use_rslora")), "scaling": scaling,
               "merged_modules": len(modules), "adapter_sha256": sha256_file(tensors_path)}
    return merged, summary


def letter_rows(weights: dict[str, np.ndarray], config: dict[str, Any], letter_ids: list[int],
                base: Path) -> np.ndarray:
    """The output projection's rows of the letters, float32 [26, H]: ``lm_head.weight``, or the
    embedding when the base ties them."""
    name = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    if name not in weights:
        raise CheckpointInvalid(f"{base / WEIGHTS_FILE}: no {name} (tie_word_embeddings="
                                f"{config.get('tie_word_embeddings')!r})")
    projection = weights[name]
    if projection.ndim != 2 or projection.shape[1] != config["hidden_size"] or max(letter_ids) >= projection.shape[0]:
        raise CheckpointInvalid(f"{base / WEIGHTS_FILE}: {name} {projection.shape} cannot hold rows "
                                f"{letter_ids} of width {config['hidden_size']}")
    return np.ascontiguousarray(projection[letter_ids], dtype=np.float32)


def prompt_template(checkpoint: Path) -> PromptTemplate:
    """The prompt as data: the checkpoint's ``prompt_template.json`` strings or the documented
    defaults, with the base's chat template and the special tokens transformers passes to it."""
    strings = {"system_message": DEFAULT_SYSTEM_MESSAGE, "user_message": DEFAULT_USER_MESSAGE,
               "option_line": DEFAULT_OPTION_LINE}
    own = checkpoint / PROMPT_TEMPLATE_FILE
    if own.is_file():
        data = _read_json(own)
        unknown = sorted(set(data) - set(CHECKPOINT_PROMPT_KEYS))
        if unknown:
            raise CheckpointInvalid(f"{own}: {unknown[0]} is not one of {', '.join(CHECKPOINT_PROMPT_KEYS)}")
        strings.update(data)
    tokenizer_config = _read_json(checkpoint / BASE_DIR / "tokenizer_config.json")
    chat_template = tokenizer_config.get("chat_template")
    template_file = checkpoint / BASE_DIR / "chat_template.jinja"
    if chat_template is None and template_file.is_file():
        chat_template = template_file.read_text(encoding="utf-8")
    if not isinstance(chat_template, str):
        raise CheckpointInvalid(f"{checkpoint / BASE_DIR}: needs a chat template (tokenizer_config.json "
                                f"chat_template as one string, or chat_template.jinja)")
    special_tokens = {key: tokenizer_config[key] for key in SPECIAL_TOKEN_KEYS
                      if isinstance(tokenizer_config.get(key), str)}
    try:
        return PromptTemplate(chat_template=chat_template, special_tokens=special_tokens, **strings)
    except ValueError as exc:
        raise CheckpointInvalid(f"{checkpoint}: prompt template: {exc}") from None


def head_graph(rows: np.ndarray) -> onnx.ModelProto:
    """``letter_logits = hidden_states @ rows^T``: [P, H] -> [P, 26], float32, P symbolic."""
    letters, hidden_size = rows.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", [INPUT_NAME, "letter_rows_t"], [OUTPUT_NAME], name="letter_logits")],
        "cua_s1_letter_head",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["P", hidden_size])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["P", letters])],
        initializer=[numpy_helper.from_array(np.ascontiguousarray(rows.T), "letter_rows_t")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="omnigraph.pipelines.cua_s1.export", producer_version=omnigraph_version,
                              ir_version=IR_VERSION)
    onnx.checker.check_model(model, full_check=True)
    return model


def reference_letter_logits(hidden: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The head in NumPy float64: what the graph must reproduce."""
    return hidden.astype(np.float64) @ rows.astype(np.float64).T


def checkpoint_revision(checkpoint: Path) -> str:
    """sha256 over the checkpoint's files (backbone, adapter, prompt template), by relative name."""
    digest = hashlib.sha256()
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(checkpoint).as_posix()}\0{sha256_file(path)}\n".encode())
    return f"sha256:{digest.hexdigest()}"


def cached_bundle(checkpoint: Path) -> Path:
    """The fp32 bundle of `checkpoint`, built once into the cache, keyed by the checkpoint's
    content and the exporter version."""
    checkpoint = Path(checkpoint)
    key = {"checkpoint": checkpoint_revision(checkpoint), "exporter": EXPORTER_VERSION, "onnx": onnx.__version__}
    return cached_folder("bundles", f"{checkpoint.name}-fp32", key, lambda out: build_bundle(checkpoint, out))


def default_bundle() -> Path:
    """The embedded demo: the tiny synthetic checkpoint as an fp32 bundle, built once into the cache."""
    return cached_bundle(cached_checkpoint("tiny"))
