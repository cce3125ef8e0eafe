"""synthesize_checkpoint: the released Open-Jev layout, deterministic, loadable, with a visible head."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from omnigraph.pipelines.open_jev.synth import cached_checkpoint, synthesize_checkpoint


def test_the_checkpoint_has_the_released_layout(jev_checkpoint):
    files = sorted(str(p.relative_to(jev_checkpoint)) for p in jev_checkpoint.rglob("*") if p.is_file())
    assert files == ["backbone/config.json", "backbone/generation_config.json", "backbone/model.safetensors",
                     "backbone/tokenizer.json", "backbone/tokenizer_config.json", "head.safetensors",
                     "temperature.json"]
    assert json.loads((jev_checkpoint / "temperature.json").read_text()) == {"temperature": 1.5}
    head = load_file(str(jev_checkpoint / "head.safetensors"))
    assert head["head_w"].shape == (128,) and head["b"].shape == () and head["b"] != 0
    config = json.loads((jev_checkpoint / "backbone" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["hidden_size"] == 128


def test_same_seed_same_bytes(jev_checkpoint, tmp_path):
    again = synthesize_checkpoint("tiny", seed=0, out=tmp_path / "again")
    for path in jev_checkpoint.rglob("*"):
        if path.is_file():
            assert (again / path.relative_to(jev_checkpoint)).read_bytes() == path.read_bytes(), path


def test_candidate_scores_differ_visibly_and_noul_is_not_pinned(jev_reference):
    request = {"state": "My parcel is late and I was billed twice.", "questions": {
        "team": {"type": "choice", "instructions": "Which team handles it?",
                 "criteria": ["billing", "shipping", "returns", "other"]},
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}}
    answers = jev_reference.answers(request)
    assert np.ptp(answers["team"]) > 0.1
    assert 0.02 < answers["refund"][1] < 0.98


def test_existing_out_and_unknown_sizes_are_refused(jev_checkpoint, tmp_path):
    with pytest.raises(FileExistsError):
        synthesize_checkpoint("tiny", seed=0, out=jev_checkpoint)
    with pytest.raises(ValueError, match="unknown Open-Jev checkpoint size 'huge'"):
        synthesize_checkpoint("huge", seed=0, out=tmp_path / "x")


def test_the_cache_synthesizes_once(monkeypatch, tmp_path):
    monkeypatch.setenv("OMNIGRAPH_CACHE", str(tmp_path))
    first = cached_checkpoint("tiny")
    assert first.parent == tmp_path / "checkpoints"
    mtime = (first / "head.safetensors").stat().st_mtime_ns
    assert cached_checkpoint("tiny") == first and (first / "head.safetensors").stat().st_mtime_ns == mtime
