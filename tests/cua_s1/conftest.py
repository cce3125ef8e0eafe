"""Shared Cua-S1 fixtures: the tiny synthetic checkpoint, its bundle and a processor on it.

Session-scoped and written under pytest's temporary folder, so the suite synthesizes and exports
once. Names: `cua_checkpoint` (`Path`), `cua_bundle` (`VerifiedBundle`), `cua_processor`
(`CuaS1Processor`), and `reference_messages(...)`, the chat a test builds itself from DESIGN.md's
documented prompt contract, to compare against what the processor renders.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omnigraph.bundles import VerifiedBundle

# Reference models load local folders only; make sure nothing reaches for the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SYSTEM_MESSAGE = (
    "You are a one-pass computer-use decision model. You are shown the current state of a screen "
    "and a fixed, closed list of candidate (element, action) options, each given a single letter. "
    "Choose exactly one option: the single best next action to take. Answer with ONLY that "
    "option's letter -- no words, no punctuation, no explanation."
)


def reference_messages(goal: str, state: str, labels: list[str]) -> list[dict[str, str]]:
    """The documented Cua-S1 chat for one question, written out independently of prompt.py."""
    options = "\n".join(f'{"ABCDEFGHIJKLMNOPQRSTUVWXYZ"[i]}. Decision "{label}" -> select'
                        for i, label in enumerate(labels))
    user = (f"Goal: {goal}\n\nApp: Cua Driver\nTask family: closed-candidate decision\n\n"
            f"Accessibility tree:\n{state}\n\nOptions:\n{options}\n\nAnswer with a single letter.")
    return [{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": user}]


@pytest.fixture(scope="session")
def cua_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnigraph.pipelines.cua_s1.synth import synthesize_checkpoint

    return synthesize_checkpoint("tiny", seed=0, out=tmp_path_factory.mktemp("cua-tiny") / "checkpoint")


@pytest.fixture(scope="session")
def cua_bundle(tmp_path_factory: pytest.TempPathFactory, cua_checkpoint: Path) -> VerifiedBundle:
    from omnigraph.pipelines.cua_s1.export import build_bundle

    return build_bundle(cua_checkpoint, tmp_path_factory.mktemp("cua-tiny-bundle") / "bundle")


@pytest.fixture(scope="session")
def cua_processor(cua_bundle: VerifiedBundle):
    from omnigraph.pipelines.cua_s1.processor import CuaS1Processor

    return CuaS1Processor({1: cua_bundle})


def reference_letter_probabilities(model, prompt_ids: list[int], letter_ids: list[int], n: int):
    """The transformers + NumPy reference: the causal LM's own logits of the first n letters at
    the last prompt position, softmaxed in float64."""
    import numpy as np
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0, -1, letter_ids[:n]].double().numpy()
    p = np.exp(logits - logits.max())
    return p / p.sum()


def reference_hidden_state(model, prompt_ids: list[int]):
    """transformers' final-norm hidden state at the last prompt position, float32 [H]."""
    import torch

    with torch.no_grad():
        return model.model(torch.tensor([prompt_ids])).last_hidden_state[0, -1].float().numpy()
