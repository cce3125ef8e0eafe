"""The Qwen pipelines' cached checkpoints are keyed on the shared backbone synthesiser's version."""

from __future__ import annotations

import importlib

import pytest

from omnigraph.bundles import staged_bundle_dir


@pytest.mark.parametrize("model", ["cua_s1", "open_jev"])
def test_a_new_qwen_backbone_generator_is_a_new_cached_checkpoint(model, monkeypatch, tmp_path):
    synth = importlib.import_module(f"omnigraph.pipelines.{model}.synth")
    monkeypatch.setenv("OMNIGRAPH_CACHE", str(tmp_path))
    built = []

    def empty_checkpoint(size, *, seed, out):
        built.append(out)
        with staged_bundle_dir(out):
            pass
        return out

    monkeypatch.setattr(synth, "synthesize_checkpoint", empty_checkpoint)
    first = synth.cached_checkpoint("tiny")
    assert synth.cached_checkpoint("tiny") == first
    monkeypatch.setattr(synth, "BACKBONE_GENERATOR_VERSION", synth.BACKBONE_GENERATOR_VERSION + 1)
    second = synth.cached_checkpoint("tiny")
    assert second != first and built == [first, second]
