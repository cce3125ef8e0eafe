"""Shared Open-Jev fixtures: a tiny synthetic checkpoint, its head bundle, and a reference scorer.

Session-scoped, written under pytest's temporary folder, so the suite synthesizes and exports once:

- `jev_checkpoint`: `Path` of `synthesize_checkpoint("tiny", seed=0)`;
- `jev_bundle`: its `VerifiedBundle`;
- `jev_processor`: an `OpenJevProcessor` on that bundle;
- `jev_reference`: a `Reference` that answers a request with transformers and NumPy only, from the
  same checkpoint files (its own prompt rendering, tokenizer, final hidden state, head and
  softmax), which the pipeline must agree with.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from omnigraph.bundles import VerifiedBundle

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class Reference:
    """Open-Jev on transformers + NumPy: prompts, token ids, scores and probabilities per question."""

    def __init__(self, checkpoint: Path) -> None:
        import torch
        from safetensors.numpy import load_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint / "backbone")
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint / "backbone", dtype=torch.float32).eval()
        head = load_file(str(checkpoint / "head.safetensors"))
        self.head_w, self.b = head["head_w"].astype(np.float64), float(head["b"])
        self.temperature = json.loads((checkpoint / "temperature.json").read_text())["temperature"]

    def prompts(self, request: dict) -> dict[str, list[str]]:
        """Each question's prompts, rendered here from the model's prompt contract (not the processor's code)."""
        def text(value) -> str:  # strings as they are, anything else as JSON with sorted keys
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)

        out = {}
        for qid, question in request["questions"].items():
            instructions = text(question["instructions"])
            criteria = question.get("criteria")
            if question["type"] == "noul":
                if criteria:
                    sides = {side.lower(): value for side, value in criteria.items()}
                    instructions += f"\nYes means: {text(sides.get('true') or 'yes, the statement holds')}" \
                                    f"\nNo means: {text(sides.get('false') or 'no, the statement does not hold')}"
                candidates = None
            elif question["type"] == "score":
                candidates = [text(level) for level in criteria]
            elif isinstance(criteria, list):
                candidates = [str(label) for label in criteria]
            else:
                candidates = [label if not desc else f"{label}: {text(desc)}" for label, desc in criteria.items()]
            prefix = f"Context:\n{text(request['state'])}\n\nQuestion: {instructions}\n"
            if candidates is None:
                out[qid] = [prefix + "Is the answer to this question yes? Answer Yes or No."]
            else:
                out[qid] = [prefix + f"Proposed answer: {c}\nIs this proposed answer correct? Answer Yes or No."
                            for c in candidates]
        return out

    def token_ids(self, request: dict) -> dict[str, list[list[int]]]:
        return {qid: [self.tokenizer(p)["input_ids"] for p in prompts]
                for qid, prompts in self.prompts(request).items()}

    def hidden_state(self, ids: list[int]) -> np.ndarray:
        """The final-norm hidden state at the prompt's last position."""
        torch = self._torch
        with torch.inference_mode():
            return self.model.model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()

    def scores(self, ids: list[list[int]]) -> np.ndarray:
        return np.array([self.hidden_state(prompt) @ self.head_w + self.b for prompt in ids])

    def probabilities(self, qtype: str, scores: np.ndarray) -> np.ndarray:
        v = np.array([0.0, scores[0]]) if qtype == "noul" else scores
        e = np.exp((v - v.max()) / self.temperature)
        return e / e.sum()

    def answers(self, request: dict) -> dict[str, np.ndarray]:
        """Each question's unrounded probabilities (noul: [p_false, p_true])."""
        return {qid: self.probabilities(request["questions"][qid]["type"], self.scores(ids))
                for qid, ids in self.token_ids(request).items()}


def assert_matches_reference(response: dict, request: dict, reference: Reference, *, tol: float = 1e-3) -> None:
    """The response's probabilities are the reference's within `tol`; usage counts prompt tokens."""
    expected = reference.answers(request)
    for qid, question in request["questions"].items():
        answer, p = response["answers"][qid], expected[qid]
        assert answer["type"] == question["type"]
        if question["type"] == "noul":
            assert math.isclose(answer["noul"], p[1], abs_tol=tol), (qid, answer, p)
            continue
        assert np.allclose(list(answer["probabilities"].values()), p, atol=tol), (qid, answer, p)
        if question["type"] == "score":
            assert math.isclose(answer["score"], float((np.arange(len(p)) * p).sum()), abs_tol=tol * len(p))
    tokens = sum(len(ids) for prompts in reference.token_ids(request).values() for ids in prompts)
    assert response["usage"] == {"input_tokens": tokens, "output_tokens": 0}


@pytest.fixture(scope="session")
def jev_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnigraph.pipelines.open_jev.synth import synthesize_checkpoint

    return synthesize_checkpoint("tiny", seed=0, out=tmp_path_factory.mktemp("open-jev") / "checkpoint")


@pytest.fixture(scope="session")
def jev_bundle(tmp_path_factory: pytest.TempPathFactory, jev_checkpoint: Path) -> VerifiedBundle:
    from omnigraph.pipelines.open_jev.export import build_bundle

    return build_bundle(jev_checkpoint, tmp_path_factory.mktemp("open-jev-bundle") / "bundle")


@pytest.fixture(scope="session")
def jev_processor(jev_bundle: VerifiedBundle):
    from omnigraph.pipelines.open_jev.processor import OpenJevProcessor

    return OpenJevProcessor({1: jev_bundle})


@pytest.fixture(scope="session")
def jev_reference(jev_checkpoint: Path) -> Reference:
    return Reference(jev_checkpoint)
