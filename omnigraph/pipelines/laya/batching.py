"""Laya's batch adapter: work items of several requests in one decision-graph call, and back.

The processor's work items hold real rows only, each item padded in length and marker slots to
its own buckets (``sequence.BatchLayout``). Items share a call when their padded lengths fall in
the same power-of-two class (17-32, 33-64, ..., 257-512 tokens), so a merged call pads no row to
more than twice its own bucket; its length and marker slots are padded to the widest item's. The
stage's limits bound a call's rows, tokens and bytes; its marker slots (padded rows x padded slots)
are Laya's own notion, so this adapter caps them itself (``fits``): at most
``BatchLayout.max_marker_slots`` (2048), the most one request's own work item holds, so a merged
call's scorer needs no more memory than the largest request makes alone. Where
a call runs at a fixed shape (a captured CUDA graph, a TensorRT engine) its rows are padded to a
power of two (the layout's ``rows`` bucket) by repeating its last real row; a CUDA-graph route
captures only calls of up to ``cuda_graph_max_rows`` rows, so larger calls keep their exact rows,
as they do wherever ONNX Runtime takes any row count: padding rows there would only burn compute.
Unpacking gives each item its own rows and marker slots: padded rows and slots never reach a
response, and every question is still decoded on its own row (normalisation per question, usage per
request, in ``processor.finish``).

Padding cannot change a real row's answer: attention masks padded tokens, ``marker_mask`` masks
padded slots, and rows never mix in the graph; on CPU fp32 the logits are bit-identical whatever
the call's length, slots or rows (tests/laya/test_batching.py compares the JSON).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING

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
# Each input of a packed call: its dtype, the value its padded positions hold (None: the layout's
# pad_id) and the width its second axis is padded to (None: it has none).
_PACKED_INPUTS = {
    "input_ids": (np.int64, None, "length"),
    "attention_mask": (np.int64, 0, "length"),
    "marker_pos": (np.int64, 0, "markers"),
    "marker_mask": (np.bool_, False, "markers"),
    "qtype": (np.int64, None, None),
}


class LayaBatchAdapter:
    """Groups, packs and unpacks Laya decision work items (see the module docstring)."""

    def __init__(self, bundle: VerifiedBundle, route: WorkerRoute, *,
                 max_marker_slots: int = BatchLayout.max_marker_slots) -> None:
        layout = bundle.manifest.metadata.layout or {}
        if "pad_id" not in layout:
            raise ValueError(f"{bundle.manifest_path}: metadata.layout has no pad_id")
        self._layout = BatchLayout(pad_id=layout["pad_id"], max_len=layout.get("max_len", BatchLayout.max_len))
        self.fixed_shapes = route.enable_cuda_graph or route.ep == "tensorrt"
        if self.fixed_shapes and layout.get("unpadded", False):
            raise ValueError(f"{bundle.manifest_path}: this bundle computes real tokens only "
                             f"(metadata.layout.unpadded), "
                             f"whose shapes follow the data; route {route.name!r} runs fixed shapes (a CUDA graph or "
                             f"a TensorRT engine): build a bf16 or fp16 bundle for it")
        # rows up to this run at fixed shapes (None: any number of rows does)
        self._fixed_shape_rows = route.cuda_graph_max_rows if route.enable_cuda_graph else None
        # padded rows x padded marker slots of one merged call
        self._max_marker_slots = max_marker_slots

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
                         widths=(tensors["marker_pos"].shape[1],))

    def padded(self, total: Footprint) -> BatchShape:
        rows = self.padded_rows(total.rows)
        (markers,) = total.widths
        return BatchShape(rows=rows, tokens=rows * total.length,
                          bytes=rows * (total.length * _TOKEN_BYTES + markers * _MARKER_BYTES + _ROW_BYTES),
                          real_rows=total.rows, real_tokens=total.tokens)

    def fits(self, total: Footprint) -> bool:
        """Whether the call's padded rows x marker slots stay within the adapter's cap."""
        (markers,) = total.widths
        return self.padded_rows(total.rows) * markers <= self._max_marker_slots

    def pack(self, items: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """The items' rows in order, then any padding rows, repeating the last real row.

        One ``np.concatenate`` per input: only an item narrower than the call (in tokens or marker
        slots) is widened first, so a call of items of one shape costs a copy of each input.
        """
        real = sum(item["input_ids"].shape[0] for item in items)
        rows = self.padded_rows(real)
        if len(items) == 1 and rows == real:
            return dict(items[0])
        widths = {"length": max(item["input_ids"].shape[1] for item in items),
                  "markers": max(item["marker_pos"].shape[1] for item in items)}
        packed: dict[str, np.ndarray] = {}
        for name, (dtype, fill, axis) in _PACKED_INPUTS.items():
            parts = [item[name] for item in items]
            if axis is not None:
                width, fill = widths[axis], self._layout.pad_id if fill is None else fill
                parts = [part if part.shape[1] == width else _widened(part, width, fill) for part in parts]
            if rows > real:
                parts.append(np.broadcast_to(parts[-1][-1:], (rows - real, *parts[-1].shape[1:])))
            packed[name] = np.concatenate(parts, dtype=dtype)
        return packed

    def unpack(self, outputs: Mapping[str, np.ndarray],
               items: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Each item's ``logits`` [rows, its slots] and ``act_logits`` [rows, 2]: views of one copy
        of the call's outputs (which may live in a buffer the worker reuses)."""
        rows = self.padded_rows(sum(item["input_ids"].shape[0] for item in items))
        markers = max(item["marker_pos"].shape[1] for item in items)
        for name, shape in (("logits", (rows, markers)), ("act_logits", (rows, 2))):
            if name not in outputs or outputs[name].shape != shape:
                got = list(outputs[name].shape) if name in outputs else "missing"
                raise ValueError(f"decision graph output {name!r} is {got}; the packed call needs {list(shape)}")
        logits, act_logits = np.array(outputs["logits"]), np.array(outputs["act_logits"])
        shares = []
        start = 0
        for item in items:
            stop = start + item["input_ids"].shape[0]
            shares.append({"logits": logits[start:stop, :item["marker_pos"].shape[1]],
                           "act_logits": act_logits[start:stop]})
            start = stop
        return shares


def _widened(array: np.ndarray, width: int, fill: int | bool) -> np.ndarray:
    """`array` [rows, n] padded on the right with `fill` to [rows, width]."""
    widened = np.full((array.shape[0], width), fill, dtype=array.dtype)
    widened[:, :array.shape[1]] = array
    return widened
