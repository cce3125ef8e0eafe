"""Shared Laya fixtures: synthetic checkpoints, their fp32 bundles, the reference agent, batches.

Everything is session-scoped and written under pytest's temporary folder, so the whole Laya
suite synthesizes and exports each size once. Names:

- `laya_tiny_checkpoint`, `laya_small_checkpoint`: `Path`s of synthetic checkpoints (seed 0);
- `laya_tiny_bundle`, `laya_small_bundle`: `VerifiedBundle`s of their fp32 bundles;
- `laya_reference_tiny`, `laya_reference_small`: the `laya.load` agents on those checkpoints
  (skipped where the `laya` test dependency is absent);
- `laya_tiny_batches`, `laya_small_batches`: collated batches built with `laya.common.build_sequence`
  and `collate_items` (dicts of the five graph inputs as numpy arrays), with varied lengths,
  1 to 100 options, every question type and padded rows;
- `laya_tiny_expected`, `laya_small_expected`: the reference model's `(logits, act_logits)` for
  each of those batches (`agent.model(input_ids, attention_mask, marker_pos, marker_mask, qtype)`).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from omnigraph.bundles import VerifiedBundle

# The reference loads local folders only; make sure it never reaches for the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

GRAPH_INPUTS = ("input_ids", "attention_mask", "marker_pos", "marker_mask", "qtype")


def _checkpoint(tmp_path_factory: pytest.TempPathFactory, size: str) -> Path:
    from omnigraph.pipelines.laya.synth import synthesize_checkpoint

    return synthesize_checkpoint(size, seed=0, out=tmp_path_factory.mktemp(f"laya-{size}") / "checkpoint")


def _bundle(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path, size: str) -> VerifiedBundle:
    from omnigraph.pipelines.laya.export import build_bundle

    return build_bundle(checkpoint, tmp_path_factory.mktemp(f"laya-{size}-bundle") / "bundle")


def load_reference(checkpoint: Path):
    """`laya.load` on a synthetic checkpoint, quietly (its calibration carries a clamped value)."""
    laya = pytest.importorskip("laya")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return laya.load(str(checkpoint), device="cpu")


def collated_batches(tokenizer, *, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Batches as the reference builds them: varied states, 1 to 100 options, all three types."""
    common = pytest.importorskip("laya.common")
    rng = np.random.default_rng(seed)
    words = ("refund order please charge late customer angry ticket email billing thanks error "
             "invoice twice support answer account").split()

    def text(n: int) -> str:
        return " ".join(words[i] for i in rng.integers(len(words), size=n))

    def question(kind: str, options: int) -> dict:
        if kind == "choice":
            return {"t": "choice", "ins": f"Which label fits {text(3)}?",
                    "crit": {f"label{j}": f"case {j} {text(int(rng.integers(0, 6)))}" for j in range(options)}}
        if kind == "score":
            return {"t": "score", "ins": "How severe is it?", "crit": [f"severity {text(2)}" for _ in range(options)]}
        return {"t": "noul", "ins": f"Is the customer asking for {text(2)}?"}

    specs = (  # (type, options, state words) per row; rows of one batch share its padding
        (("choice", 3, 10), ("noul", 2, 40), ("score", 5, 25)),
        (("choice", 2, 300), ("noul", 2, 3)),
        (("choice", 100, 50),),
        (("choice", 11, 600), ("score", 4, 120), ("noul", 2, 0), ("choice", 7, 70)),
        (("noul", 2, 1),),
        (("choice", 1, 20),),
        (("choice", 30, 200), ("noul", 2, 5)),
    )
    batches = []
    for spec in specs:
        items = []
        for kind, options, state_words in spec:
            ids, markers = common.build_sequence(tokenizer, text(state_words), question(kind, options), 512, 192)
            items.append({"ids": ids, "markers": markers, "qtype": common.QTYPES[kind]})
        collated = common.collate_items([items], tokenizer.pad_token_id)
        batches.append({name: collated[name].numpy() for name in GRAPH_INPUTS})
    return batches


@pytest.fixture(scope="session")
def laya_tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def laya_small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory, "small")


@pytest.fixture(scope="session")
def laya_tiny_bundle(tmp_path_factory: pytest.TempPathFactory, laya_tiny_checkpoint: Path) -> VerifiedBundle:
    return _bundle(tmp_path_factory, laya_tiny_checkpoint, "tiny")


@pytest.fixture(scope="session")
def laya_small_bundle(tmp_path_factory: pytest.TempPathFactory, laya_small_checkpoint: Path) -> VerifiedBundle:
    return _bundle(tmp_path_factory, laya_small_checkpoint, "small")


@pytest.fixture(scope="session")
def laya_reference_tiny(laya_tiny_checkpoint: Path):
    return load_reference(laya_tiny_checkpoint)


@pytest.fixture(scope="session")
def laya_reference_small(laya_small_checkpoint: Path):
    return load_reference(laya_small_checkpoint)


@pytest.fixture(scope="session")
def laya_tiny_batches(laya_reference_tiny) -> list[dict[str, np.ndarray]]:
    return collated_batches(laya_reference_tiny.tok)


@pytest.fixture(scope="session")
def laya_small_batches(laya_reference_small) -> list[dict[str, np.ndarray]]:
    return collated_batches(laya_reference_small.tok)


def _reference_outputs(agent, batches: list[dict[str, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
    torch = pytest.importorskip("torch")
    outputs = []
    with torch.no_grad():
        for batch in batches:
            logits, act_logits = agent.model(*(torch.from_numpy(batch[name]) for name in GRAPH_INPUTS))
            outputs.append((logits.numpy(), act_logits.numpy()))
    return outputs


@pytest.fixture(scope="session")
def laya_tiny_expected(laya_reference_tiny, laya_tiny_batches) -> list[tuple[np.ndarray, np.ndarray]]:
    return _reference_outputs(laya_reference_tiny, laya_tiny_batches)


@pytest.fixture(scope="session")
def laya_small_expected(laya_reference_small, laya_small_batches) -> list[tuple[np.ndarray, np.ndarray]]:
    return _reference_outputs(laya_reference_small, laya_small_batches)
