"""The controller <-> graph worker wire: one frame codec, no pickle (stdlib + numpy only).

This module is the conformance surface: a worker written in any language speaks it by following
this docstring, and the conformance runner checks the error codes listed below.

Frame layout (all integers little-endian)::

    prefix   24 bytes, struct "<4sHHIQI": magic b"OGWF", wire version (u16), flags (u16, must be
             0), header length (u32), payload length (u64), reserved (u32, must be 0)
    header   UTF-8 JSON object, strict: no NaN/Infinity, no duplicate keys
    payload  the inline tensor bytes, each tensor at a 64-byte aligned offset, padded to 64 bytes

Header fields (all required)::

    v                  wire version (== the prefix version)
    type               one of MESSAGE_TYPES
    request_id         str (at most 256 characters)
    stage_id           int >= 0
    epoch              int >= 0: the cancellation epoch; stale epochs are refused
    generation         int >= 0: the worker generation the controller started
    instance           str: the worker process's random id (announced in its hello, which carries it)
    features_required  list of str: the receiver refuses a frame naming a feature it lacks
    tensors            list of descriptors (below)
    body               JSON object: the message's non-tensor content

Tensor descriptor: ``{"name", "dtype", "shape", "nbytes"}`` plus exactly one of ``"offset"``
(inline: byte offset into the payload) or ``"fd"`` (shared memory: index of the file descriptor
passed with the frame). ``nbytes`` must equal prod(shape) * itemsize. The payload holds exactly the
inline extents: its length is the sum of the inline tensors' nbytes, each rounded up to 64.

Messages (controller -> worker, then the worker's answer; any request may be answered by ``error``
with body ``{"code", "message"}``, plus ``"report"`` (a placement report) for placement_refused)::

    (on connect)                      hello  {interpreter, versions, providers, pid, start time,
                                             instance, wire_version, features}
    load   {manifest_path}         -> loaded {the LoadReport}
    run    tensors: the inputs     -> result tensors: the outputs
    stats  {}                      -> stats_result {rss_bytes, peak_rss_bytes, counters, ...}
    fence  (epoch in the header)   -> no answer: the worker refuses lower epochs from then on
    close  {}                      -> closing, then the worker exits 0

Binary header (feature ``"binary_header"``, which the worker announces in its hello; the
controller uses it only then): the fast path of ``run`` and ``result``, no JSON to write or parse.
Its prefix has the magic MAGIC_BINARY instead of MAGIC (same layout otherwise); the header is::

    fixed    struct "<BBHHQQQ": message type (1 run, 2 result), tensor count, request id length,
             instance length (UTF-8 bytes), stage_id, epoch, generation
    strings  the request id, then the instance (UTF-8)
    tensors  per tensor: struct "<BBHQ" dtype code (the index in WIRE_DTYPES' order), rank, name
             length, nbytes; then rank dims (u64 each); then the name (UTF-8)

The header is consumed exactly (a byte left over, or missing, is malformed_header). Tensors lie
inline only, in descriptor order, each at the next 64-byte aligned offset of the payload (so there
are no offsets to check), and the payload is exactly their aligned sum. Every other check and code
is the JSON header's; the body is {} and no feature is required. A message that does not fit (a
body, another type, a tensor for shared memory) is sent with the JSON header.

Mailbox (feature ``"mailbox"``, which the worker announces when the controller gave it one; see
workers/mailbox.py): a binary-header ``run`` or ``result`` frame, byte for byte as above, may be
written into a shared-memory area instead of the socket (write_binary_frame) and is read back with
the same checks (read_binary_frame); a frame that does not fit goes through the socket.

Shared memory (feature ``"shm_fd"``, part of wire version 1, so a receiver accepts it): a tensor
may travel in an anonymous memory file (``memfd_create``) whose descriptor comes with the frame as
SCM_RIGHTS ancillary data on the Unix socket. The receiver maps it copy-on-write and closes the
descriptor at once, so the memory lives exactly as long as the receiver's arrays; the sender
closes its own copy once sent. omnigraph's own ends never send one: a memory file per tensor lost
to the inline socket at every size measured, 4 KB to 64 MB, on both project machines
(benchmarks/results/wire-*.md), so its sender was deleted.

bfloat16: numpy has no bfloat16, so a bfloat16 tensor is decoded as a uint16 array holding the
raw bits (``arr.view(ml_dtypes.bfloat16)`` where ml_dtypes is installed). The encoder sends an
array whose dtype is named "bfloat16" (ml_dtypes) as bfloat16; a uint16 array is refused
(uint16 is not on the wire).

Every check runs on the prefix and the header before a byte of payload is read or allocated.

Error codes (``WireError.code``, stable):

    bad_magic                 the prefix does not start with MAGIC or MAGIC_BINARY, or
                              flags/reserved are not 0
    unsupported_version       the prefix or header version is not WIRE_VERSION
    header_too_large          header length above MAX_HEADER_BYTES (or zero)
    payload_too_large         payload length, or the bytes of all tensors, above the route's cap
    malformed_header          not UTF-8 JSON, NaN/Infinity, duplicate keys, a field missing or of
                              the wrong type, an unknown message type
    unknown_required_feature  features_required names a feature this side lacks
    unknown_dtype             a dtype outside the whitelist (WIRE_DTYPES)
    bad_shape                 rank above MAX_RANK, a negative dim, a dim above MAX_DIM
    byte_length_mismatch      nbytes != prod(shape) * itemsize, payload length != the sum of the
                              inline extents, a shared-memory file of another size
    bad_extent                an inline offset unaligned, outside the payload, or overlapping
    bad_shm_reference         an fd index out of range, used twice, unused, or too many fds
    duplicate_tensor_name     two descriptors with the same name
    too_many_tensors          more than MAX_TENSORS descriptors
    truncated_frame           the stream ended inside a frame (short read)
    stale_epoch               an epoch below the highest the receiver has seen (or fenced)
    stale_generation          a generation other than the worker's
    stale_instance            an instance id other than the worker process's
"""

from __future__ import annotations

import json
import mmap
import os
import select
import socket
import struct
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

if sys.byteorder != "little":  # the payload is little-endian raw memory
    raise ImportError("the omnigraph wire needs a little-endian host")

MAGIC = b"OGWF"
MAGIC_BINARY = b"OGWB"  # the same prefix, followed by the binary header
WIRE_VERSION = 1
PREFIX = struct.Struct("<4sHHIQI")
PREFIX_BYTES = PREFIX.size

# Why: a header holds descriptors and small bodies (a placement report of a few thousand nodes is
# the largest); anything bigger is a fault or an attack, refused before it is buffered.
MAX_HEADER_BYTES = 4 * 1024 * 1024
# Why: a bound on descriptors keeps header validation O(small); no stage has more I/O than this.
MAX_TENSORS = 64
# Why: ORT graphs here are rank <= 4; 8 leaves room and bounds the product computation.
MAX_RANK = 8
# Why: no real dimension reaches 2**31; bigger values are overflow attempts.
MAX_DIM = 2**31 - 1
# Why: names and ids are identifiers, not data.
MAX_NAME_CHARS = 256
# Why: tensors start on cache lines within the payload; the receive buffer itself comes from
# numpy's allocator (16-byte aligned), so every array view is aligned for its dtype.
TENSOR_ALIGNMENT = 64
# Why: a reader that sleeps in the kernel pays the scheduler's wake-up on every message (50-100 us
# on the 2-core development VMs: benchmarks/wire.py's echo floor, against 12-15 us when both ends
# poll), so each end polls its socket for this long after its last message before sleeping, as
# vLLM's shared-memory message queue does; back-to-back calls then never sleep, and an idle
# worker sleeps after this bound. A route sets its own (WorkerRoute.spin_wait_us; 0 never polls).
SPIN_WAIT_US = 500
# Why: bounds the ancillary buffer; one fd per large tensor.
MAX_FDS = MAX_TENSORS
# Why: a frame's integers must survive a round trip through any JSON reader (int64 range).
MAX_INT = 2**63 - 1
# Why: the receive path reads in bounded chunks only when it discards an invalid frame's payload.
DISCARD_CHUNK_BYTES = 64 * 1024

MESSAGE_TYPES = frozenset(
    {"hello", "load", "loaded", "run", "result", "stats", "stats_result", "fence", "close",
     "closing", "error"}
)
FEATURE_SHM_FD = "shm_fd"
FEATURE_BINARY_HEADER = "binary_header"
FEATURES = frozenset({FEATURE_SHM_FD, FEATURE_BINARY_HEADER})
BINARY_MESSAGE_TYPES = ("run", "result")  # binary type code = index + 1
_BINARY_TYPE_CODES = {name: code for code, name in enumerate(BINARY_MESSAGE_TYPES, 1)}

# Wire dtype name -> numpy dtype used to view it (bfloat16 travels as its raw uint16 bits).
WIRE_DTYPES: dict[str, np.dtype] = {
    "bool": np.dtype(np.bool_),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}
_NUMPY_TO_WIRE = {dtype: name for name, dtype in WIRE_DTYPES.items() if name != "bfloat16"}
_DTYPE_NAMES = tuple(WIRE_DTYPES)  # binary dtype code -> wire name
_DTYPE_CODES = {name: code for code, name in enumerate(_DTYPE_NAMES)}
_BINARY_FIXED = struct.Struct("<BBHHQQQ")
_BINARY_HEAD = struct.Struct(PREFIX.format + _BINARY_FIXED.format[1:])  # a prefix and a fixed header, packed at once
_BINARY_TENSOR = struct.Struct("<BBHQ")
_BINARY_DIMS = tuple(struct.Struct(f"<{rank}Q") for rank in range(MAX_RANK + 1))
_HEADER_KEYS = frozenset(
    {"v", "type", "request_id", "stage_id", "epoch", "generation", "instance",
     "features_required", "tensors", "body"}
)


class WireError(Exception):
    """A frame broke the wire contract. ``code`` is stable; see the module docstring."""

    code = "wire_error"

    def __init__(self, message: str, *, pending_payload_bytes: int | None = None) -> None:
        super().__init__(message)
        # Payload bytes of the refused frame still unread on the stream: the receiver may discard
        # them (discard_payload) and stay in sync. None: the stream cannot be trusted any more.
        self.pending_payload_bytes = pending_payload_bytes


class BadMagic(WireError):
    code = "bad_magic"


class UnsupportedVersion(WireError):
    code = "unsupported_version"


class HeaderTooLarge(WireError):
    code = "header_too_large"


class PayloadTooLarge(WireError):
    code = "payload_too_large"


class MalformedHeader(WireError):
    code = "malformed_header"


class UnknownRequiredFeature(WireError):
    code = "unknown_required_feature"


class UnknownDtype(WireError):
    code = "unknown_dtype"


class BadShape(WireError):
    code = "bad_shape"


class ByteLengthMismatch(WireError):
    code = "byte_length_mismatch"


class BadExtent(WireError):
    code = "bad_extent"


class BadShmReference(WireError):
    code = "bad_shm_reference"


class DuplicateTensorName(WireError):
    code = "duplicate_tensor_name"


class TooManyTensors(WireError):
    code = "too_many_tensors"


class TruncatedFrame(WireError):
    code = "truncated_frame"


class StaleEpoch(WireError):
    code = "stale_epoch"


class StaleGeneration(WireError):
    code = "stale_generation"


class StaleInstance(WireError):
    code = "stale_instance"


WIRE_ERRORS: dict[str, type[WireError]] = {
    cls.code: cls
    for cls in (BadMagic, UnsupportedVersion, HeaderTooLarge, PayloadTooLarge, MalformedHeader,
                UnknownRequiredFeature, UnknownDtype, BadShape, ByteLengthMismatch, BadExtent,
                BadShmReference, DuplicateTensorName, TooManyTensors, TruncatedFrame, StaleEpoch,
                StaleGeneration, StaleInstance)
}


class PeerClosed(EOFError):
    """The peer closed the stream at a frame boundary (a clean end, not a wire fault)."""


class TensorDescriptor(NamedTuple):
    """Where one tensor of a frame lies: ``offset`` into the payload, or ``fd`` index (a named
    tuple: built once per tensor per frame, so it must be cheap)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int | None
    fd: int | None


@dataclass(slots=True)
class Frame:
    """A validated prefix + header; the payload is still on the stream (``payload_nbytes``).

    ``fds`` are the shared-memory descriptors the frame brought; the frame owns them until
    read_payload, discard_payload or close_frame closes them (and empties the tuple).
    """

    type: str
    request_id: str
    stage_id: int
    epoch: int
    generation: int
    instance: str
    features_required: tuple[str, ...]
    tensors: tuple[TensorDescriptor, ...]
    body: dict[str, Any]
    payload_nbytes: int
    fds: tuple[int, ...]
    binary: bool  # it came with the binary header (a reply may use it too)


def _reject_constant(name: str) -> Any:
    raise MalformedHeader(f"header holds the non-JSON number {name}")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise MalformedHeader(f"header repeats the key {key!r}")
            seen.add(key)
    return result


# Built once: json.dumps / json.loads with options would build a new coder on every frame.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_encode_ascii = json.encoder.encode_basestring_ascii  # the C escaper json.dumps uses
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_no_duplicate_keys)
_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS * 4)
# Copy-on-write (the arrays are the receiver's to change), faulted in with one call rather than
# one page fault per 4 KiB page on first touch.
_MAP_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)


def _align(n: int) -> int:
    return (n + TENSOR_ALIGNMENT - 1) // TENSOR_ALIGNMENT * TENSOR_ALIGNMENT


def _prod(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


# ----------------------------------------------------------------------------------------------
# Encoding


def wire_dtype_of(array: np.ndarray) -> str:
    """The wire name of an array's dtype; UnknownDtype for anything off the whitelist."""
    return _wire_dtype_name(array.dtype)


def _wire_dtype_name(dtype: np.dtype) -> str:
    name = _NUMPY_TO_WIRE.get(dtype)
    if name is not None:
        return name
    if dtype.name == "bfloat16" and dtype.itemsize == 2:
        return "bfloat16"
    raise UnknownDtype(f"dtype {dtype.str} ({dtype.name}) is not on the wire")


def _as_bytes(array: np.ndarray) -> np.ndarray:
    """The array's bytes, C-ordered: the array itself when it already is (no copy)."""
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array.reshape(-1).view(np.uint8)


_PADDING = bytes(TENSOR_ALIGNMENT)
# Each message type's header up to the request id's value (constant per type).
_HEADER_OPENINGS = {t: f'{{"v":{WIRE_VERSION},"type":"{t}","request_id":' for t in MESSAGE_TYPES}


def _json_string(value: str) -> str:
    """``value`` as a JSON string, exactly as the header encoder writes it (ASCII, escaped)."""
    if type(value) is not str:
        raise MalformedHeader(f"expected a string in the header, got {value!r}")
    return _encode_ascii(value)


class EncodedFrame:
    """A frame ready to go: its buffers (prefix and header, then the payload's pieces, the arrays'
    own memory), sent with one ``sendmsg`` (more only when the socket takes part)."""

    __slots__ = ("buffers", "nbytes")

    def __init__(self, buffers: list[Any], nbytes: int) -> None:
        self.buffers = buffers
        self.nbytes = nbytes

    def send(self, sock: socket.socket) -> None:
        _sendmsg_all(sock, self.buffers, self.nbytes)


def send_frame(sock: socket.socket, msg_type: str, **fields: Any) -> None:
    """Encode (encode_frame, same arguments) and send one frame."""
    encode_frame(msg_type, **fields).send(sock)


def encode_frame(
    msg_type: str,
    *,
    request_id: str = "",
    stage_id: int = 0,
    epoch: int = 0,
    generation: int = 0,
    instance: str = "",
    body: Mapping[str, Any] | None = None,
    tensors: Mapping[str, np.ndarray] | None = None,
    max_payload_bytes: int,
    binary: bool = False,
) -> EncodedFrame:
    """Encode one frame, its tensors inline (no copy: the payload's pieces are the arrays' memory).

    ``binary`` asks for the binary header (only where the peer announced ``binary_header``); a
    message it cannot carry (a body, a type other than run / result) goes with the JSON header.
    Refuses (before anything is sent) what the receiver would refuse: an unknown dtype, too many
    tensors, tensors whose bytes add up beyond ``max_payload_bytes``.
    """
    opening = _HEADER_OPENINGS.get(msg_type)
    if opening is None:
        raise MalformedHeader(f"unknown message type {msg_type!r}")
    _check_ids(stage_id, epoch, generation)
    tensors = tensors or {}
    if binary and not body and msg_type in BINARY_MESSAGE_TYPES:
        tensors, layout = _arrays_and_layout(tensors)
        _check_payload_fits(layout, max_payload_bytes)
        return _encode_binary(msg_type, request_id, stage_id, epoch, generation, instance, tensors, layout)
    if len(tensors) > MAX_TENSORS:
        raise TooManyTensors(f"{len(tensors)} tensors, at most {MAX_TENSORS}")
    entries: list[tuple[str, str, tuple[int, ...], int, int]] = []  # name, dtype, shape, nbytes, offset
    buffers: list[Any] = [b""]  # [0]: prefix + header, filled in below
    offset = 0
    for name, array in tensors.items():
        if type(array) is not np.ndarray:
            array = np.asarray(array)
        dtype = _NUMPY_TO_WIRE.get(array.dtype) or wire_dtype_of(array)
        if array.ndim > MAX_RANK:
            raise BadShape(f"tensor {name!r} has rank {array.ndim}, at most {MAX_RANK}")
        nbytes = array.nbytes
        if offset + nbytes > max_payload_bytes:
            raise PayloadTooLarge(f"tensors add up to more than {max_payload_bytes} bytes (at {name!r})")
        buffers.append(_as_bytes(array))
        extent = _align(nbytes)
        if extent != nbytes:
            buffers.append(_PADDING[: extent - nbytes])
        entries.append((name, dtype, array.shape, nbytes, offset))
        offset += extent
    header_bytes = _json_header(opening, request_id, stage_id, epoch, generation, instance, body, entries)
    if len(header_bytes) > MAX_HEADER_BYTES:
        raise HeaderTooLarge(f"header of {len(header_bytes)} bytes, at most {MAX_HEADER_BYTES}")
    buffers[0] = PREFIX.pack(MAGIC, WIRE_VERSION, 0, len(header_bytes), offset, 0) + header_bytes
    return EncodedFrame(buffers, len(buffers[0]) + offset)


def _json_header(opening: str, request_id: str, stage_id: int, epoch: int, generation: int, instance: str,
                 body: Mapping[str, Any] | None, entries: list[tuple[str, str, tuple[int, ...], int, int]]) -> bytes:
    """The header's JSON, written field by field in the order and the compact form of
    json.dumps(header, separators=(",", ":")): no dict to build, no encoder to walk it."""
    descriptors = ",".join(
        f'{{"name":{_json_string(name)},"dtype":"{dtype}","shape":[{",".join(map(str, shape))}],'
        f'"nbytes":{nbytes},"offset":{offset}}}'
        for name, dtype, shape, nbytes, offset in entries
    )
    return (
        f'{opening}{_json_string(request_id)},"stage_id":{stage_id},"epoch":{epoch},"generation":{generation},'
        f'"instance":{_json_string(instance)},"features_required":[],'
        f'"tensors":[{descriptors}],"body":{_ENCODER.encode(body) if body else "{}"}}}'
    ).encode()


def _binary_string(value: str) -> bytes:
    if type(value) is not str or len(value) > MAX_NAME_CHARS:
        raise MalformedHeader(f"expected a string of at most {MAX_NAME_CHARS} characters, got {value!r}")
    return value.encode()


class _BinaryLayout(NamedTuple):
    """What a binary header says about a set of tensors, whatever their values: kept by their
    (name, dtype, shape), since a stage sends the same few layouts call after call."""

    section: bytes                     # the header's tensor section
    paddings: tuple[bytes, ...]        # the zero bytes after each tensor (to the next 64)
    extents: tuple[int, ...]           # each tensor's bytes with its padding
    payload_nbytes: int                # the aligned sum


# Why: bounded, since the caller chooses the shapes (one layout per bucket shape in practice).
_BINARY_LAYOUTS_MAX = 256
_binary_layouts: dict[tuple[tuple[str, np.dtype, tuple[int, ...]], ...], _BinaryLayout] = {}


def _binary_layout(tensors: Mapping[str, np.ndarray]) -> _BinaryLayout | None:
    """The layout of ``tensors`` (refusing what the receiver would refuse); None when one of them
    is not a numpy array (the general path converts it)."""
    key = []
    for name, array in tensors.items():
        if type(array) is not np.ndarray:
            return None
        key.append((name, array.dtype, array.shape))
    layout_key = tuple(key)
    layout = _binary_layouts.get(layout_key)
    if layout is None:
        layout = _new_binary_layout(layout_key)
        if len(_binary_layouts) >= _BINARY_LAYOUTS_MAX:
            _binary_layouts.clear()
        _binary_layouts[layout_key] = layout
    return layout


def _arrays_and_layout(tensors: Mapping[str, Any]) -> tuple[Mapping[str, np.ndarray], _BinaryLayout]:
    """The tensors as arrays (a value that is not one yet converted) and their binary layout."""
    layout = _binary_layout(tensors)
    if layout is None:
        tensors = {name: np.asarray(value) for name, value in tensors.items()}
        layout = _binary_layout(tensors)
        assert layout is not None  # every value is an ndarray now
    return tensors, layout


def _check_payload_fits(layout: _BinaryLayout, max_payload_bytes: int) -> None:
    if layout.payload_nbytes > max_payload_bytes:
        raise PayloadTooLarge(f"tensors add up to {layout.payload_nbytes} bytes (64-byte aligned), "
                              f"more than {max_payload_bytes}")


def _new_binary_layout(key: tuple[tuple[str, np.dtype, tuple[int, ...]], ...]) -> _BinaryLayout:
    if len(key) > MAX_TENSORS:
        raise TooManyTensors(f"{len(key)} tensors, at most {MAX_TENSORS}")
    parts: list[bytes] = []
    paddings, extents = [], []
    total = 0
    for name, dtype, shape in key:
        if len(shape) > MAX_RANK:
            raise BadShape(f"tensor {name!r} has rank {len(shape)}, at most {MAX_RANK}")
        wire_dtype = _wire_dtype_name(dtype)
        nbytes = _prod(shape) * dtype.itemsize
        encoded = _binary_string(name)
        parts += (_BINARY_TENSOR.pack(_DTYPE_CODES[wire_dtype], len(shape), len(encoded), nbytes),
                  _BINARY_DIMS[len(shape)].pack(*shape), encoded)
        extent = _align(nbytes)
        paddings.append(_PADDING[: extent - nbytes])
        extents.append(extent)
        total += extent
    return _BinaryLayout(b"".join(parts), tuple(paddings), tuple(extents), total)


def _binary_head(msg_type: str, request_id: str, stage_id: int, epoch: int, generation: int, instance: str,
                 layout: _BinaryLayout) -> bytes:
    """The prefix and binary header of a frame of tensors whose layout is known."""
    rid, inst = _binary_string(request_id), _binary_string(instance)
    header_len = _BINARY_FIXED.size + len(rid) + len(inst) + len(layout.section)
    if header_len > MAX_HEADER_BYTES:
        raise HeaderTooLarge(f"header of {header_len} bytes, at most {MAX_HEADER_BYTES}")
    return b"".join((_BINARY_HEAD.pack(MAGIC_BINARY, WIRE_VERSION, 0, header_len, layout.payload_nbytes, 0,
                                       _BINARY_TYPE_CODES[msg_type], len(layout.paddings), len(rid), len(inst),
                                       stage_id, epoch, generation), rid, inst, layout.section))


def _encode_binary(msg_type: str, request_id: str, stage_id: int, epoch: int, generation: int, instance: str,
                   tensors: Mapping[str, np.ndarray], layout: _BinaryLayout) -> EncodedFrame:
    """A binary-header frame of tensors whose layout is known: the header from the layout's
    section, the arrays' own memory as the payload."""
    buffers: list[Any] = [_binary_head(msg_type, request_id, stage_id, epoch, generation, instance, layout)]
    for array, padding in zip(tensors.values(), layout.paddings):
        buffers.append(array if array.flags.c_contiguous else np.ascontiguousarray(array))
        if padding:
            buffers.append(padding)
    return EncodedFrame(buffers, len(buffers[0]) + layout.payload_nbytes)


def write_binary_frame(area: mmap.mmap, msg_type: str, *, request_id: str, stage_id: int, epoch: int,
                       generation: int, instance: str, tensors: Mapping[str, Any],
                       max_payload_bytes: int) -> int | None:
    """Write a binary-header ``run`` / ``result`` frame into ``area`` (a shared mapping: its slice
    assignment takes an array's memory as it is), byte for byte as send_frame would send it; its
    length, or None when it does not fit (send it through the socket). Refuses what send_frame
    refuses, before writing anything."""
    if msg_type not in BINARY_MESSAGE_TYPES:
        raise MalformedHeader(f"the binary header carries run and result only, not {msg_type!r}")
    _check_ids(stage_id, epoch, generation)
    tensors, layout = _arrays_and_layout(tensors)
    _check_payload_fits(layout, max_payload_bytes)
    head = _binary_head(msg_type, request_id, stage_id, epoch, generation, instance, layout)
    offset = len(head)
    end = offset + layout.payload_nbytes
    if end > len(area):
        return None
    area[:offset] = head
    for array, extent in zip(tensors.values(), layout.extents):
        # numpy's stubs declare an ndarray's buffer protocol (__buffer__) only from Python 3.12 on
        area[offset:offset + array.nbytes] = (  # type: ignore[call-overload]
            array if array.flags.c_contiguous else np.ascontiguousarray(array))
        offset += extent
    return end


def read_binary_frame(area: mmap.mmap, length: int, *, max_payload_bytes: int,
                      copy: bool = True) -> tuple[Frame, dict[str, np.ndarray]]:
    """Read a frame that write_binary_frame put into ``area`` and ``length`` announces, with the
    socket path's checks (only the binary header is accepted). The arrays own copies of their
    bytes, so the area may be written again at once; with ``copy=False`` they view the area
    itself, for a reader whose peer writes it again only after an answer (the worker's inputs,
    until it replies). A refused frame leaves nothing to skip."""
    if not PREFIX_BYTES <= length <= len(area):
        raise TruncatedFrame(f"a mailbox frame of {length} bytes in an area of {len(area)}")
    magic, header_len, payload_len = _checked_prefix(area, max_payload_bytes)
    if magic != MAGIC_BINARY:
        raise BadMagic(f"prefix {magic!r}: the mailbox carries binary-header frames only")
    start = PREFIX_BYTES + header_len
    if start + payload_len != length:
        raise ByteLengthMismatch(f"a frame of {start + payload_len} bytes announced as {length}")
    frame = _parse_binary_header(area[PREFIX_BYTES:start], payload_len, max_payload_bytes, 0)
    buffer: bytearray | mmap.mmap
    if copy:  # the payload alone, in the reader's own buffer
        buffer, payload_offset = bytearray(memoryview(area)[start:length]), 0
    else:
        buffer, payload_offset = area, start
    arrays = {}  # a loop, not a comprehension: one frame fewer per message before Python 3.12
    for desc in frame.tensors:  # a binary frame's tensors are all inline: each has an offset
        arrays[desc.name] = np.ndarray(desc.shape, WIRE_DTYPES[desc.dtype], buffer=buffer,
                                       offset=payload_offset + desc.offset)  # type: ignore[operator]
    return frame, arrays


def _sendmsg_all(sock: socket.socket, buffers: list[Any], total: int) -> None:
    sent = sock.sendmsg(buffers)
    if sent == total:
        return
    pending = [memoryview(b).cast("B") for b in buffers]
    while True:
        while sent and pending:
            if sent >= len(pending[0]):
                sent -= len(pending[0])
                pending.pop(0)
            else:
                pending[0] = pending[0][sent:]
                sent = 0
        if not pending:
            return
        sent = sock.sendmsg(pending)



# ----------------------------------------------------------------------------------------------
# Decoding


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the stream (inside a frame: an early end is a TruncatedFrame)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:] if got else view)
        if n == 0:
            raise TruncatedFrame(f"stream ended after {got} of {len(view)} bytes")
        got += n


def _recv_prefix(sock: socket.socket) -> tuple[bytes, list[int]]:
    """The prefix bytes and the descriptors that came with them (SCM_RIGHTS)."""
    data, ancdata, flags, _ = sock.recvmsg(PREFIX_BYTES, _ANCILLARY_BYTES)
    if len(data) == PREFIX_BYTES and not ancdata and not flags:  # the usual case
        return data, []
    fds: list[int] = []
    try:
        _collect_fds(ancdata, flags, fds)
        if not data:
            raise PeerClosed("peer closed the connection")
        while len(data) < PREFIX_BYTES:
            chunk, ancdata, flags, _ = sock.recvmsg(PREFIX_BYTES - len(data), _ANCILLARY_BYTES)
            _collect_fds(ancdata, flags, fds)
            if not chunk:
                raise TruncatedFrame(f"stream ended after {len(data)} prefix bytes")
            data += chunk
    except BaseException:
        _close_fds(fds)
        raise
    return data, fds


def _collect_fds(ancdata: list[tuple[int, int, bytes]], flags: int, fds: list[int]) -> None:
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds.extend(np.frombuffer(payload[:usable], np.int32).tolist())
    if flags & socket.MSG_CTRUNC:
        raise BadShmReference(f"more than {MAX_FDS} file descriptors with one frame")


def _close_fds(fds: list[int] | tuple[int, ...]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _check_ids(stage_id: Any, epoch: Any, generation: Any) -> None:
    """A frame's stage_id, epoch and generation, refused unless each fits [0, 2**63)."""
    if not (type(stage_id) is int and type(epoch) is int and type(generation) is int
            and 0 <= stage_id <= MAX_INT and 0 <= epoch <= MAX_INT and 0 <= generation <= MAX_INT):
        for key, value in (("stage_id", stage_id), ("epoch", epoch), ("generation", generation)):
            _checked_int(key, value)


def _checked_int(key: str, value: Any) -> int:
    """A header integer field's value, refused unless it fits [0, 2**63) (both directions)."""
    if type(value) is not int or not 0 <= value <= MAX_INT:
        raise MalformedHeader(f"header field {key!r} must be an integer in [0, 2**63), got {value!r}")
    return value


def _str_field(header: Mapping[str, Any], key: str) -> str:
    value = header[key]
    if type(value) is not str or len(value) > MAX_NAME_CHARS:
        raise MalformedHeader(f"header field {key!r} must be a string of at most {MAX_NAME_CHARS} characters")
    return value


def _parse_header(
    header_bytes: bytes | bytearray, version: int, payload_len: int, max_payload_bytes: int, fd_count: int
) -> Frame:
    """Validate a header (its prefix already checked); raises the specific WireError, whose
    ``pending_payload_bytes`` says the stream is still in sync. Allocates nothing for payload."""
    try:
        header = _DECODER.decode(header_bytes.decode("utf-8"))
        return _validate_header(header, version, payload_len, max_payload_bytes, fd_count)
    except WireError as exc:
        exc.pending_payload_bytes = payload_len
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise MalformedHeader(f"header is not UTF-8 JSON: {exc}", pending_payload_bytes=payload_len) from None


def _validate_header(
    header: Any, version: int, payload_len: int, max_payload_bytes: int, fd_count: int
) -> Frame:
    if type(header) is not dict:
        raise MalformedHeader("header must be a JSON object")
    if header.keys() != _HEADER_KEYS:
        missing, unknown = sorted(_HEADER_KEYS - header.keys()), sorted(header.keys() - _HEADER_KEYS)
        raise MalformedHeader(f"header fields missing {missing}, unknown {unknown}")
    if header["v"] != version:
        raise UnsupportedVersion(f"header version {header['v']!r} disagrees with prefix version {version}")
    msg_type = header["type"]
    if msg_type not in MESSAGE_TYPES:
        raise MalformedHeader(f"unknown message type {msg_type!r}")
    features = header["features_required"]
    if type(features) is not list:
        raise MalformedHeader("features_required must be a list of strings")
    if features:  # most frames require none
        if not all(type(f) is str for f in features):
            raise MalformedHeader("features_required must be a list of strings")
        lacking = [f for f in features if f not in FEATURES]
        if lacking:
            raise UnknownRequiredFeature(f"required features {lacking} are not supported (have {sorted(FEATURES)})")
    body = header["body"]
    if type(body) is not dict:
        raise MalformedHeader("body must be a JSON object")
    descriptors = header["tensors"]
    if type(descriptors) is not list:
        raise MalformedHeader("tensors must be a list")
    tensors = _validate_descriptors(descriptors, payload_len, max_payload_bytes, fd_count)
    return Frame(
        type=msg_type,
        request_id=_str_field(header, "request_id"),
        stage_id=_checked_int("stage_id", header["stage_id"]),
        epoch=_checked_int("epoch", header["epoch"]),
        generation=_checked_int("generation", header["generation"]),
        instance=_str_field(header, "instance"),
        features_required=tuple(features),
        tensors=tensors,
        body=body,
        payload_nbytes=payload_len,
        fds=(),
        binary=False,
    )


def _bad_dim(name: str, dim: Any) -> str:
    if type(dim) is not int:
        return f"tensor {name!r} has a non-integer dim {dim!r}"
    if dim < 0:
        return f"tensor {name!r} has a negative dim {dim}"
    return f"tensor {name!r} has a dim {dim} above {MAX_DIM}"


def _check_name_and_dtype(name: Any, dtype: Any, names: set[str]) -> None:
    """A descriptor's name (unique in its frame) and dtype, whichever header carried them."""
    if type(name) is not str or not name or len(name) > MAX_NAME_CHARS:
        raise MalformedHeader(f"tensor name must be a non-empty string of at most {MAX_NAME_CHARS} characters")
    if name in names:
        raise DuplicateTensorName(f"tensor {name!r} appears twice")
    names.add(name)
    if type(dtype) is not str or dtype not in WIRE_DTYPES:
        raise UnknownDtype(f"tensor {name!r} has dtype {dtype!r}; allowed: {sorted(WIRE_DTYPES)}")


def _check_shape_and_nbytes(name: str, dtype: str, shape: tuple[Any, ...], nbytes: Any) -> None:
    """Rank and dims in bounds, and nbytes exactly prod(shape) * itemsize."""
    if len(shape) > MAX_RANK:
        raise BadShape(f"tensor {name!r} has rank {len(shape)}, at most {MAX_RANK}")
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= MAX_DIM:
            raise BadShape(_bad_dim(name, dim))
    expected = _prod(shape) * WIRE_DTYPES[dtype].itemsize
    if type(nbytes) is not int or nbytes != expected:
        raise ByteLengthMismatch(f"tensor {name!r}: nbytes {nbytes!r} but shape {list(shape)} of {dtype} is "
                                 f"{expected} bytes")


def _binary_text(header: bytes, start: int, length: int, what: str) -> str:
    end = start + length
    if end > len(header):
        raise MalformedHeader(f"binary header ends inside the {what}")
    text = header[start:end].decode("utf-8")
    if len(text) > MAX_NAME_CHARS:
        raise MalformedHeader(f"{what} must be at most {MAX_NAME_CHARS} characters")
    return text


def _parse_binary_header(header: bytes | bytearray, payload_len: int, max_payload_bytes: int, fd_count: int) -> Frame:
    """Validate a binary header (layout in the module docstring), like _parse_header does a JSON one."""
    try:
        if fd_count:
            raise BadShmReference(f"{fd_count} descriptors came with a binary-header frame, which carries tensors "
                                  "inline only")
        header = bytes(header)  # a bytearray off the socket: its slices must hash
        type_code, count, id_length, instance_length, stage_id, epoch, generation = _BINARY_FIXED.unpack_from(header)
        if not 1 <= type_code <= len(BINARY_MESSAGE_TYPES):
            raise MalformedHeader(f"binary message type {type_code} is not one of 1 (run), 2 (result)")
        request_id = _binary_text(header, _BINARY_FIXED.size, id_length, "request id")
        tail = (header[_BINARY_FIXED.size + id_length:], count, instance_length, max_payload_bytes)
        checked = _checked_tails.get(tail)
        if checked is None:
            checked = _checked_tail(*tail)
            if len(_checked_tails) >= _CHECKED_TAILS_MAX:
                _checked_tails.clear()
            _checked_tails[tail] = checked
        instance, tensors, inline_total = checked
        if inline_total != payload_len:
            raise ByteLengthMismatch(f"payload is {payload_len} bytes but the inline tensors take {inline_total} "
                                     "(64-byte aligned)")
        if stage_id > MAX_INT or epoch > MAX_INT or generation > MAX_INT:  # unsigned: only the top can be out
            _check_ids(stage_id, epoch, generation)
    except WireError as exc:
        exc.pending_payload_bytes = payload_len
        raise
    except (struct.error, UnicodeDecodeError) as exc:
        raise MalformedHeader(f"binary header unreadable: {exc}", pending_payload_bytes=payload_len) from None
    return Frame(BINARY_MESSAGE_TYPES[type_code - 1], request_id, stage_id, epoch, generation, instance, (), tensors,
                 {}, payload_len, (), True)


# Why: what follows the request id in a binary header (the instance, then the tensor section)
# repeats call after call (one worker process, the same few tensor layouts), so its validated
# reading is kept by its exact bytes and a repeated one is not parsed again; bounded, since a peer
# chooses the shapes.
_CHECKED_TAILS_MAX = 256
_checked_tails: dict[tuple[bytes, int, int, int], tuple[str, tuple[TensorDescriptor, ...], int]] = {}


def _checked_tail(tail: bytes, count: int, instance_length: int,
                  max_payload_bytes: int) -> tuple[str, tuple[TensorDescriptor, ...], int]:
    """The instance, the tensor descriptors and the payload bytes they take, read from the part of a
    binary header after its request id."""
    instance = _binary_text(tail, 0, instance_length, "instance")
    return (instance, *_checked_tensor_section(tail[instance_length:], count, max_payload_bytes))


def _checked_tensor_section(section: bytes, count: int,
                            max_payload_bytes: int) -> tuple[tuple[TensorDescriptor, ...], int]:
    """The descriptors of a binary header's tensor section and the payload bytes they take."""
    if count > MAX_TENSORS:
        raise TooManyTensors(f"{count} tensors, at most {MAX_TENSORS}")
    tensors: list[TensorDescriptor] = []
    names: set[str] = set()
    position = offset = 0
    for _ in range(count):
        code, rank, name_length, nbytes = _BINARY_TENSOR.unpack_from(section, position)
        position += _BINARY_TENSOR.size
        if rank > MAX_RANK:
            raise BadShape(f"tensor #{len(tensors)} has rank {rank}, at most {MAX_RANK}")
        shape = _BINARY_DIMS[rank].unpack_from(section, position)
        position += 8 * rank
        name = _binary_text(section, position, name_length, "tensor name")
        position += name_length
        dtype = _DTYPE_NAMES[code] if code < len(_DTYPE_NAMES) else f"code {code}"
        _check_name_and_dtype(name, dtype, names)
        _check_shape_and_nbytes(name, dtype, shape, nbytes)
        if offset + nbytes > max_payload_bytes:
            raise PayloadTooLarge(f"tensors add up to more than {max_payload_bytes} bytes (at {name!r})")
        tensors.append(TensorDescriptor(name, dtype, shape, nbytes, offset, None))
        offset += _align(nbytes)
    if position != len(section):
        raise MalformedHeader(f"binary header has {len(section) - position} bytes after its last tensor")
    return tuple(tensors), offset


def _validate_descriptors(
    descriptors: list[Any], payload_len: int, max_payload_bytes: int, fd_count: int
) -> tuple[TensorDescriptor, ...]:
    if len(descriptors) > MAX_TENSORS:
        raise TooManyTensors(f"{len(descriptors)} tensors, at most {MAX_TENSORS}")
    result: list[TensorDescriptor] = []
    names: set[str] = set()
    fds_used: set[int] = set()
    extents: list[tuple[int, int, str]] = []
    total = 0
    for desc in descriptors:
        name, dtype, shape, nbytes = _descriptor_fields(desc)
        _check_name_and_dtype(name, dtype, names)
        if type(shape) is not list:
            raise BadShape(f"tensor {name!r} shape must be a list")
        shape_t = tuple(shape)
        _check_shape_and_nbytes(name, dtype, shape_t, nbytes)
        total += nbytes
        if total > max_payload_bytes:
            raise PayloadTooLarge(f"tensors add up to more than {max_payload_bytes} bytes (at {name!r})")
        offset, fd = desc.get("offset"), desc.get("fd")
        if offset is not None:
            extents.append(_inline_extent(name, offset, nbytes, payload_len))
        else:
            fds_used.add(_shm_reference(name, fd, nbytes, fd_count, fds_used))
        result.append(TensorDescriptor(name, dtype, shape_t, nbytes, offset, fd))
    if len(fds_used) != fd_count:
        raise BadShmReference(f"{fd_count} descriptors came with the frame but {len(fds_used)} are referenced")
    _check_extents_fill(extents, payload_len)
    return tuple(result)


def _descriptor_fields(desc: Any) -> tuple[Any, Any, Any, Any]:
    """A JSON tensor descriptor's name, dtype, shape and nbytes, unchecked; its keys checked."""
    if type(desc) is not dict:
        raise MalformedHeader("a tensor descriptor must be a JSON object")
    # five keys, the four required ones and exactly one of offset / fd: nothing else fits
    if len(desc) != 5 or "name" not in desc or "dtype" not in desc or "shape" not in desc \
            or "nbytes" not in desc or ("offset" in desc) == ("fd" in desc):
        raise MalformedHeader(
            f"a tensor descriptor needs name, dtype, shape, nbytes and one of offset/fd; got {sorted(desc)}"
        )
    return desc["name"], desc["dtype"], desc["shape"], desc["nbytes"]


def _inline_extent(name: str, offset: Any, nbytes: int, payload_len: int) -> tuple[int, int, str]:
    """An inline tensor's [offset, end) in the payload: aligned and inside it."""
    if type(offset) is not int or offset < 0 or offset % TENSOR_ALIGNMENT:
        raise BadExtent(f"tensor {name!r}: offset {offset!r} is not a {TENSOR_ALIGNMENT}-aligned byte offset")
    end = offset + _align(nbytes)
    if end > payload_len:
        raise BadExtent(f"tensor {name!r}: extent [{offset}, {end}) ends beyond the payload ({payload_len} bytes)")
    return offset, end, name


def _shm_reference(name: str, fd: Any, nbytes: int, fd_count: int, fds_used: set[int]) -> int:
    """A shared-memory tensor's index among the frame's descriptors: in range, used once, not empty."""
    if type(fd) is not int or not 0 <= fd < fd_count:
        raise BadShmReference(f"tensor {name!r}: fd index {fd!r} but {fd_count} descriptors came with the frame")
    if fd in fds_used:
        raise BadShmReference(f"tensor {name!r}: fd index {fd} is used twice")
    if nbytes == 0:
        raise BadShmReference(f"tensor {name!r}: an empty tensor must travel inline")
    return fd


def _check_extents_fill(extents: list[tuple[int, int, str]], payload_len: int) -> None:
    """The inline tensors do not overlap and take the whole payload."""
    extents.sort()
    for (_, end, first), (start, _, second) in zip(extents, extents[1:]):
        if start < end:
            raise BadExtent(f"tensors {first!r} and {second!r} overlap in the payload")
    inline_total = sum(end - start for start, end, _ in extents)
    if inline_total != payload_len:
        raise ByteLengthMismatch(
            f"payload is {payload_len} bytes but the inline tensors take {inline_total} (64-byte aligned)"
        )


class SpinWait:
    """Waits, without sleeping, until one socket is readable or ``spin_us`` have passed.

    Called before a blocking read: when the next message (or the peer's close) arrives within the
    bound, the read finds it there and the process never sleeps; past the bound the read sleeps in
    the kernel as usual. Each poll first yields the CPU to any other runnable thread, so polling
    does not starve other work on a busy machine."""

    def __init__(self, sock: socket.socket, spin_us: int) -> None:
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)  # hang-ups and errors are always reported too
        self._spin_s = spin_us / 1e6

    def __call__(self) -> None:
        if not self._spin_s or self._poll.poll(0):
            return
        end = time.perf_counter() + self._spin_s
        while not self._poll.poll(0) and time.perf_counter() < end:
            os.sched_yield()


def _checked_prefix(buffer: bytes | mmap.mmap, max_payload_bytes: int) -> tuple[bytes, int, int]:
    """The magic, header length and payload length of the prefix at the start of ``buffer``, once
    every field is within bounds."""
    magic, version, flags, header_len, payload_len, reserved = PREFIX.unpack_from(buffer)
    if magic not in (MAGIC, MAGIC_BINARY) or flags != 0 or reserved != 0:
        raise BadMagic(f"prefix {magic!r} flags {flags} reserved {reserved}: not an omnigraph frame")
    if version != WIRE_VERSION:
        raise UnsupportedVersion(f"wire version {version}, this side speaks {WIRE_VERSION}")
    if header_len == 0 or header_len > MAX_HEADER_BYTES:
        raise HeaderTooLarge(f"header length {header_len}, allowed 1..{MAX_HEADER_BYTES}")
    if payload_len > max_payload_bytes:
        raise PayloadTooLarge(f"payload length {payload_len}, at most {max_payload_bytes}")
    return magic, header_len, payload_len


def read_frame(sock: socket.socket, *, max_payload_bytes: int) -> Frame:
    """Read and validate one prefix + header; the payload stays on the stream.

    On a WireError whose ``pending_payload_bytes`` is not None the caller may call
    discard_payload to stay in sync; otherwise the stream must be closed.
    """
    prefix, fds = _recv_prefix(sock)
    try:
        magic, header_len, payload_len = _checked_prefix(prefix, max_payload_bytes)
        header_bytes: bytes | bytearray = sock.recv(header_len)  # the length is capped above
        if len(header_bytes) != header_len:  # a long header may arrive in pieces
            buffer = bytearray(header_len)
            buffer[: len(header_bytes)] = header_bytes
            _recv_exact_into(sock, memoryview(buffer)[len(header_bytes):])
            header_bytes = buffer
        if magic == MAGIC_BINARY:
            frame = _parse_binary_header(header_bytes, payload_len, max_payload_bytes, len(fds))
        else:
            frame = _parse_header(header_bytes, WIRE_VERSION, payload_len, max_payload_bytes, len(fds))
        for desc in frame.tensors:
            if desc.fd is not None:
                size = os.fstat(fds[desc.fd]).st_size
                if size != desc.nbytes:
                    raise ByteLengthMismatch(
                        f"tensor {desc.name!r}: shared memory holds {size} bytes, descriptor says {desc.nbytes}",
                        pending_payload_bytes=payload_len,
                    )
    except BaseException:
        _close_fds(fds)
        raise
    frame.fds = tuple(fds)
    return frame


def read_payload(sock: socket.socket, frame: Frame) -> dict[str, np.ndarray]:
    """Receive the payload of a validated frame; arrays view the payload or the shared memory."""
    if not frame.tensors:
        return {}
    try:
        payload = np.empty(frame.payload_nbytes, np.uint8)  # numpy's allocator: 16-byte aligned
        _recv_exact_into(sock, memoryview(payload))  # type: ignore[arg-type]  # numpy: __buffer__ only from 3.12
        arrays: dict[str, np.ndarray] = {}
        for desc in frame.tensors:
            dtype = WIRE_DTYPES[desc.dtype]
            if desc.fd is not None:
                mapping = mmap.mmap(frame.fds[desc.fd], desc.nbytes, flags=_MAP_FLAGS,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
                arrays[desc.name] = np.ndarray(desc.shape, dtype, buffer=mapping)
            else:
                # an inline tensor has an offset (only a shared-memory one has none)
                arrays[desc.name] = np.ndarray(desc.shape, dtype, buffer=payload, offset=desc.offset)  # type: ignore[arg-type]
        return arrays
    finally:
        close_frame(frame)


def discard_payload(sock: socket.socket, frame_or_nbytes: Frame | int) -> None:
    """Skip a refused frame's payload through a small fixed buffer (nothing sized by the peer)."""
    if isinstance(frame_or_nbytes, Frame):
        close_frame(frame_or_nbytes)
        remaining = frame_or_nbytes.payload_nbytes
    else:
        remaining = frame_or_nbytes
    scratch = memoryview(bytearray(min(remaining, DISCARD_CHUNK_BYTES)))
    while remaining:
        n = sock.recv_into(scratch[:min(remaining, len(scratch))])
        if n == 0:
            raise TruncatedFrame(f"stream ended with {remaining} payload bytes unread")
        remaining -= n


def close_frame(frame: Frame) -> None:
    """Close the shared-memory descriptors a frame brought (idempotent)."""
    _close_fds(frame.fds)
    frame.fds = ()


def recv_message(sock: socket.socket, *, max_payload_bytes: int) -> tuple[Frame, dict[str, np.ndarray]]:
    """read_frame + read_payload: one whole message."""
    frame = read_frame(sock, max_payload_bytes=max_payload_bytes)
    return frame, read_payload(sock, frame)
