"""Generate a tiny bundle from a manifest case, then damage it the way the case says.

`send.bundle`: `{"graph": <name in setup.graphs>, "graph_file"?: "graph.onnx", "component"?,
"example_inputs"?: {"file": "inputs.npz", "tensors": {name: tensor spec}}, "files"?: {name: text}}`
is written and packed with `omnigraph.bundles.pack_bundle`. `send.mutations` then runs in order:

| op | fields | effect |
|---|---|---|
| `append` | `file`, `text` | append bytes to a member (its hash no longer matches) |
| `write` | `file`, `text` | write a file inside the bundle (creates folders) |
| `write_outside` | `file`, `text` | write a file in `outside/`, a sibling of the bundle folder |
| `delete` | `file` | remove a file of the bundle (manifest.json too) |
| `symlink` | `file`, `to` | make `file` a symbolic link to `to` (relative to the link) |
| `manifest_set` | `path`, `value` | set a key of manifest.json (`path`: list of keys) |
| `manifest_delete` | `path` | remove a key of manifest.json |
| `manifest_text` | `text` | replace manifest.json with these exact characters |
| `external_location` | `file`, `tensor`, `location` | point an external-data tensor of graph `file` elsewhere |
| `rehash` | | recompute the sha256 of every listed file that exists |

`send.open`: `"folder"` (default) or `"manifest"`: which path the target is given.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from omnigraph.bundles import MANIFEST_NAME, pack_bundle, sha256_file
from omnigraph.conformance.graphs import write_model
from omnigraph.conformance.suite import FixtureInvalid
from omnigraph.conformance.tensors import tensor_from_spec

BUNDLE_FOLDER = "bundle"
OUTSIDE_FOLDER = "outside"


def build_case_bundle(send: Mapping[str, Any], graphs: Mapping[str, Any], workdir: Path, *, where: str) -> Path:
    """Write, pack and mutate the case's bundle under `workdir`; the path to give the target."""
    spec = send.get("bundle")
    if not isinstance(spec, dict) or spec.get("graph") not in graphs:
        raise FixtureInvalid(f"{where}: send.bundle.graph must name one of setup.graphs {sorted(graphs)}")
    root = workdir / BUNDLE_FOLDER
    (workdir / OUTSIDE_FOLDER).mkdir(parents=True)
    graph_file = spec.get("graph_file", "graph.onnx")
    (root / graph_file).parent.mkdir(parents=True, exist_ok=True)
    write_model(graphs[spec["graph"]], (root / graph_file).parent, Path(graph_file).name, where=where)
    example = spec.get("example_inputs")
    if example is not None:
        arrays = {name: tensor_from_spec(t, where=f"{where} example input {name}")
                  for name, t in example["tensors"].items()}
        with open(root / example["file"], "wb") as handle:
            np.savez(handle, allow_pickle=False, **arrays)
    for name, text in spec.get("files", {}).items():
        _write(root / name, text)
    pack_bundle(
        root,
        component=spec.get("component", "conformance.graph"),
        graph_file=graph_file,
        example_inputs_file=None if example is None else example["file"],
    )
    for index, mutation in enumerate(send.get("mutations", [])):
        _mutate(root, workdir / OUTSIDE_FOLDER, mutation, where=f"{where} mutation #{index}")
    opened = send.get("open", "folder")
    if opened not in ("folder", "manifest"):
        raise FixtureInvalid(f"{where}: send.open must be 'folder' or 'manifest', got {opened!r}")
    return root if opened == "folder" else root / MANIFEST_NAME


def _mutate(root: Path, outside: Path, mutation: Mapping[str, Any], *, where: str) -> None:
    op = mutation.get("op")
    if op == "append":
        with open(root / mutation["file"], "ab") as handle:
            handle.write(mutation["text"].encode())
    elif op == "write":
        _write(root / mutation["file"], mutation["text"])
    elif op == "write_outside":
        _write(outside / mutation["file"], mutation["text"])
    elif op == "delete":
        (root / mutation["file"]).unlink()
    elif op == "symlink":
        link = root / mutation["file"]
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.exists() or link.is_symlink():
            link.unlink()
        os.symlink(mutation["to"], link)
    elif op in ("manifest_set", "manifest_delete"):
        manifest = _read_manifest(root)
        *parents, last = mutation["path"]
        holder = manifest
        for key in parents:
            holder = holder[key]
        if op == "manifest_set":
            holder[last] = mutation["value"]
        else:
            del holder[last]
        _write_manifest(root, manifest)
    elif op == "manifest_text":
        (root / MANIFEST_NAME).write_text(mutation["text"], encoding="utf-8")
    elif op == "external_location":
        _relocate_external(root / mutation["file"], mutation["tensor"], mutation["location"], where=where)
    elif op == "rehash":
        manifest = _read_manifest(root)
        for name in manifest["files"]:
            if (root / name).is_file():
                manifest["files"][name] = sha256_file(root / name)
        _write_manifest(root, manifest)
    else:
        raise FixtureInvalid(f"{where}: unknown mutation op {op!r}")


def _relocate_external(graph_path: Path, tensor_name: str, location: str, *, where: str) -> None:
    model = onnx.load(str(graph_path), load_external_data=False)
    for tensor in model.graph.initializer:
        if tensor.name == tensor_name and tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = location
            graph_path.write_bytes(model.SerializeToString())
            return
    raise FixtureInvalid(f"{where}: {graph_path.name} has no external tensor {tensor_name!r}")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode())


def _read_manifest(root: Path) -> dict[str, Any]:
    return json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))


def _write_manifest(root: Path, manifest: Mapping[str, Any]) -> None:
    (root / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
