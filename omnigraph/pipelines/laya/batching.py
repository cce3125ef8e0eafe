"""Laya's batch adapter: work items of several requests in one decision-graph call, and back.

The processor's work items hold real rows only, each item padded in length and marker slots to
its own buckets (``sequence.BatchLayout``). Items share a call when their padded lengths fall in
the same power-of-two class (17-32, 33-64, ..., 257-512 tokens), so a merged call pads no row to
more than twice its own bucket; its length and marker slots are padded to the widest item's. Where
a call runs at a fixed shape (a captured CUDA graph, a TensorRT engine) its rows are padded to a
power of two (the layout's ``rows`` bucket) by repeating its last real row; a CUDA-graph route
captures only calls of up to ``cuda_graph_max_rows`` rows, so larger calls keep their exact rows,
as they do wherever ONNX Runtime takes any row count: padding rows there would only burn compute.
Unpacking gives each item its own rows and marker slots: padded rows and slots never reach a
response, and every question is still decoded on its own row (normalisation per question, usage per request, in ``processor.finish``).

Padding cannot change a real row's answer: attention masks padded tokens, ``marker_mask`` masks
padded slots, and rows never mix in the graph; on CPU fp32 the logits are bit-identical whatever
the call's length, slots or rows (tests/laya/test_batching.py compares the JSON).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Mapping, Sequence

import numpy as np

from omnigraph.pipelines.laya.sequence import BatchLayout
from omnigraph.stages.batching import BatchShape, Footprint

if TYPE_CHECKING:
    from omnigraph.bundles import VerifiedBundle
    from omnigraph.workers.route import WorkerRoute

__all__ = ["GRAPH_INPUTS", "LayaBatchAdapter"]

#: The decision graph's inputs, as the processor builds them.
GRAPH_INPUTS = frozenset({"input_ids", "attention_mask", "marker_pos", "marker_mask", "qtype"})
# Input bytes of one padded row: two int64 token arrays per position, int64 + bool per marker
# slot, one int64 qtype.
_TOKEN_BYTES, _MARKER_BYTES, _ROW_BYTES = 16, 9, 8


class LayaBatchAdapter:
    """Groups, packs and unpacks Laya decision work items (see the module docstring)."""

    def __init__(self, bundle: VerifiedBundle, route: WorkerRoute) -> None:
        layout = bundle.manifest.metadata.layout or {}
        if "pad_id" not in layout:
            raise ValueError(f"{bundle.manifest_path}: metadata.layout has no pad_id")
        self._layout = BatchLayout(pad_id=layout["pad_id"], max_len=layout.get("max_len", BatchLayout.max_len))
        self.fixed_shapes = route.enable_cuda_graph or route.ep == "tensorrt"
        # rows up to this run at fixed shapes (None: any number of rows does)
        self._fixed_shape_rows = route.cuda_graph_max_rows if route.enable_cuda_graph else None

    def padded_rows(self, rows: int) -> int:
        """The rows of a call holding `rows` real rows: their bucket where the call's shape is fixed."""
        if not self.fixed_shapes or (self._fixed_shape_rows is not None and rows > self._fixed_shape_rows):
            return rows
        return self._layout.rows_bucket(rows)

    def group(self, tensors: Mapping[str, np.ndarray]) -> Hashable | None:
        """The item's length class; None (runs alone) for anything but the five graph inputs."""
        if tensors.keys() != GRAPH_INPUTS:
            return None
        return max(0, tensors["input_ids"].shape[1] - 1).bit_length()

    def footprint(self, tensors: Mapping[str, np.ndarray]) -> Footprint:
        rows, length = tensors["input_ids"].shape
        return Footprint(rows=rows, tokens=int(np.count_nonzero(tensors["attention_mask"])), length=length,
                         markers=tensors["marker_pos"].shape[1])

    def padded(self, total: Footprint) -> BatchShape:
        rows = self.padded_rows(total.rows)
        return BatchShape(rows=rows, tokens=rows * total.length, markers=rows * total.markers,
                          bytes=rows * (total.length * _TOKEN_BYTES + total.markers * _MARKER_BYTES + _ROW_BYTES),
                          real_rows=total.rows, real_tokens=total.tokens)

    def pack(self, items: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The items' rows in order, then any padding rows, repeating the last real row."""
        real = sum(item["input_ids"].shape[0] for item in items)
        rows = self.padded_rows(real)
        if len(items) == 1 and rows == real:
            return dict(items[0])
        length = max(item["input_ids"].shape[1] for item in items)
        markers = max(item["marker_pos"].shape[1] for item in items)
        packed = {
            "input_ids": np.full((rows, length), self._layout.pad_id, dtype=np.int64),
            "attention_mask": np.zeros((rows, length), dtype=np.int64),
            "marker_pos": np.zeros((rows, markers), dtype=np.int64),
            "marker_mask": np.zeros((rows, markers), dtype=bool),
            "qtype": np.zeros(rows, dtype=np.int64),
        }
        start = 0
        for item in items:
            stop = start + item["input_ids"].shape[0]
            for name, array in packed.items():
                source = item[name]
                array[(slice(start, stop), *(slice(0, n) for n in source.shape[1:]))] = source
            start = stop
        for array in packed.values():
            array[real:] = array[real - 1]
        return packed

    def unpack(self, outputs: Mapping[str, np.ndarray],
               items: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Each item's ``logits`` [rows, its slots] and ``act_logits`` [rows, 2]."""
        rows = self.padded_rows(sum(item["input_ids"].shape[0] for item in items))
        markers = max(item["marker_pos"].shape[1] for item in items)
        for name, shape in (("logits", (rows, markers)), ("act_logits", (rows, 2))):
            if name not in outputs or outputs[name].shape != shape:
                got = list(outputs[name].shape) if name in outputs else "missing"
                raise ValueError(f"decision graph output {name!r} is {got}; the packed call needs {list(shape)}")
        shares = []
        start = 0
        for item in items:
            stop = start + item["input_ids"].shape[0]
            shares.append({"logits": outputs["logits"][start:stop, :item["marker_pos"].shape[1]].copy(),
                           "act_logits": outputs["act_logits"][start:stop].copy()})
            start = stop
        return shares
