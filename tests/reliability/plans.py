"""Deploy plans of the embedded demo Laya for the reliability tests: one graph stage on the CPU."""

from __future__ import annotations

from pathlib import Path

import yaml

from omnigraph.pipelines.laya.export import default_bundle


def demo_plan(folder: Path, *, replicas: int = 1, manifest: Path | None = None, **backend: object) -> Path:
    """`folder/plan.yaml`: the demo bundle (or `manifest`) as `replicas` CPU replicas, with any
    further `backend` keys (e.g. `hang_grace_s=0.5`)."""
    stage = {"stage_id": 0, "num_replicas": replicas,
             "backend": {"name": "external.graph.v1", "manifest": str(manifest or default_bundle()),
                         "route": {"name": "local-cpu", "ep": "cpu"}, **backend}}
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump({"pipeline": "laya", "stages": [stage]}))
    return path
