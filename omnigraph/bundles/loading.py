"""The bytes a graph worker runs: a bundle verified with its graph, external data, example inputs
and custom-op library read into memory and hashed from those very bytes.

A worker that verified files and then let ONNX Runtime open them by path would run whatever the
files hold by then: a weights file changed in place after verification was served under the
verified hash. A session built from a LoadedBundle's bytes cannot run anything else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from omnigraph.bundles.errors import MemberInvalid
from omnigraph.bundles.external_data import external_data_references
from omnigraph.bundles.hashing import read_file
from omnigraph.bundles.onnx_graph import parse_graph_structure
from omnigraph.bundles.verify import VerifiedBundle, complete_verification, read_bundle_layout


@dataclass(frozen=True)
class LoadedBundle:
    """A verified bundle and the verified bytes a session is built from.

    `external_data` maps each external-data location, as the graph writes it (what ONNX Runtime's
    `SessionOptions.add_external_initializers_from_files_in_memory` takes as the file name), to
    that member's bytes. Drop the object once the sessions are built: it holds the weights.
    """

    bundle: VerifiedBundle
    graph: bytes
    external_data: dict[str, bytes]
    example_inputs: bytes | None
    custom_ops_library: bytes | None


def load_bundle(path: str | os.PathLike[str]) -> LoadedBundle:
    """verify_bundle(path), keeping the bytes of the graph, its external data, the example inputs
    and the custom-op library as read and hashed (one read of each; the other members are hashed
    from disk)."""
    layout = read_bundle_layout(path)
    root, metadata = layout.root, layout.manifest.metadata
    contents = {metadata.graph_file: read_file(root / metadata.graph_file)}
    try:
        model = parse_graph_structure(contents[metadata.graph_file][0], source=root / metadata.graph_file)
    except MemberInvalid:  # verification below names the fault first found: a hash, or this parse
        model = None
    references = {} if model is None else external_data_references(root, metadata.graph_file, model)
    for member in references:
        if member in layout.manifest.files:  # an unlisted one is refused by the verification below
            contents[member] = read_file(root / member)
    custom_ops = layout.manifest.custom_ops
    kept = (metadata.example_inputs_file, None if custom_ops is None else custom_ops.library_file)
    for name in kept:
        if name is not None:
            contents[name] = read_file(root / name)
    bundle = complete_verification(layout, contents)
    return LoadedBundle(
        bundle=bundle,
        graph=contents[metadata.graph_file][0],
        external_data={location: contents[member][0] for member, (location, _) in references.items()},
        example_inputs=None if kept[0] is None else contents[kept[0]][0],
        custom_ops_library=None if kept[1] is None else contents[kept[1]][0],
    )
