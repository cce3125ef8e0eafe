"""Turn a wire case into the exact bytes (and shared-memory descriptors) a target receives.

The frame is built here from the layout documented in `omnigraph.workers.wire` (a 24-byte prefix,
a JSON header, 64-byte aligned inline tensors), not by the codec under test, so a codec that
drifts from its documented layout fails the suite. `send` keys (all optional but `tensors`):

    message            the header's type (default "run")
    tensors            [{"name", "dtype", "shape", "values" | "fill",
                         "transport"?: "inline" | "shm", "shm_bytes"?: size of the memory file,
                         "descriptor"?: {field: value} written over the descriptor,
                         "descriptor_remove"?: [field, ...]}]
    body               the header's body (default {})
    header             {field: value} written over the header (last, so anything can be broken)
    header_remove      [field, ...] removed from the header
    header_text        the header's exact text, replacing the JSON built from the rest
    header_padding     N: body["padding"] = "x" * N (an oversized header made honestly)
    prefix             {"magic" (text), "version", "flags", "header_length", "payload_length",
                        "reserved"} written over the prefix fields
    payload_extra      N zero bytes appended after the tensors
    truncate           {"keep": N} or {"drop": N}: only the first N bytes, or all but the last N,
                       are sent; the stream then ends
    extra_fds          N unreferenced memory files sent with the frame
    header_format      "json" (default) or "binary": the binary header (feature binary_header,
                       prefix magic MAGIC_BINARY); inline tensors only, laid out in order
    binary             {field: value} written over the binary header's fixed fields: "type"
                       (1 run, 2 result), "tensor_count", "stage_id", "epoch", "generation"
    tensors[i].binary  {field: value} written over that tensor's binary fields: "dtype_code",
                       "rank", "name_length", "nbytes"
    header_extra       N zero bytes appended to the header (a header that is not consumed exactly)

Session fields (request_id, stage_id, epoch, generation, instance) come from the caller.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from omnigraph.conformance.suite import FixtureInvalid
from omnigraph.conformance.tensors import tensor_from_spec
from omnigraph.workers.wire import MAGIC, MAGIC_BINARY, PREFIX, TENSOR_ALIGNMENT, WIRE_DTYPES, WIRE_VERSION

# The binary header's layout, restated from the wire docstring (not imported from the codec).
_BINARY_FIXED = struct.Struct("<BBHHQQQ")
_BINARY_TENSOR = struct.Struct("<BBHQ")
_BINARY_TYPES = {"run": 1, "result": 2}


@dataclass(frozen=True)
class BuiltFrame:
    data: bytes  # what is written to the stream (already cut when `truncate` is set)
    shm_payloads: tuple[bytes, ...]  # contents of the memory files sent with the frame, in fd order
    ends_stream: bool  # True: the sender shuts its side down after the bytes (a truncated frame)
    tensors: dict[str, np.ndarray]  # the arrays the frame carries, for round-trip checks


def build_frame(send: Mapping[str, Any], *, session: Mapping[str, Any], where: str) -> BuiltFrame:
    """The bytes of the case's frame; `session` gives request_id, stage_id, epoch, generation, instance."""
    descriptors: list[dict[str, Any]] = []
    binary_fields: list[dict[str, Any]] = []  # per tensor: overrides of its binary header fields
    payload = bytearray()
    shm: list[bytes] = []
    arrays: dict[str, np.ndarray] = {}
    for index, spec in enumerate(send.get("tensors", [])):
        name = spec.get("name")
        array = tensor_from_spec(spec, where=f"{where} tensor #{index}")
        arrays[name] = array
        raw = np.ascontiguousarray(array).tobytes()
        descriptor: dict[str, Any] = {"name": name, "dtype": spec["dtype"], "shape": list(array.shape),
                                      "nbytes": len(raw)}
        transport = spec.get("transport", "inline")
        if transport == "shm":
            descriptor["fd"] = len(shm)
            size = spec.get("shm_bytes", len(raw))
            shm.append(raw[:size] + bytes(max(0, size - len(raw))))
        elif transport == "inline":
            descriptor["offset"] = len(payload)
            payload += raw + bytes(-len(raw) % TENSOR_ALIGNMENT)
        else:
            raise FixtureInvalid(f"{where} tensor #{index}: transport must be 'inline' or 'shm', got {transport!r}")
        descriptor.update(spec.get("descriptor", {}))
        binary_fields.append(spec.get("binary", {}))
        for key in spec.get("descriptor_remove", []):
            descriptor.pop(key, None)
        descriptors.append(descriptor)
    shm += [b"\0" * TENSOR_ALIGNMENT] * send.get("extra_fds", 0)
    payload += bytes(send.get("payload_extra", 0))
    header_format = send.get("header_format", "json")
    if header_format == "binary":
        header_bytes = _binary_header_bytes(send, session, descriptors, binary_fields, where=where)
    elif header_format == "json":
        header_bytes = _header_bytes(send, session, descriptors)
    else:
        raise FixtureInvalid(f"{where}: header_format must be 'json' or 'binary', got {header_format!r}")
    header_bytes += bytes(send.get("header_extra", 0))
    fields = {
        "magic": MAGIC_BINARY if header_format == "binary" else MAGIC,
        "version": WIRE_VERSION,
        "flags": 0,
        "header_length": len(header_bytes),
        "payload_length": len(payload),
        "reserved": 0,
    }
    overrides = dict(send.get("prefix", {}))
    if "magic" in overrides:
        overrides["magic"] = overrides["magic"].encode()
    unknown = set(overrides) - set(fields)
    if unknown:
        raise FixtureInvalid(f"{where}: unknown prefix fields {sorted(unknown)}")
    fields.update(overrides)
    prefix = PREFIX.pack(*(fields[key] for key in
                           ("magic", "version", "flags", "header_length", "payload_length", "reserved")))
    data = prefix + header_bytes + bytes(payload)
    truncate = send.get("truncate")
    if truncate is not None:
        keep = truncate.get("keep", len(data) - truncate.get("drop", 0))
        if not 0 <= keep < len(data):
            raise FixtureInvalid(f"{where}: truncate must keep fewer than the frame's {len(data)} bytes, "
                                 f"got {truncate}")
        data = data[:keep]
    return BuiltFrame(data=data, shm_payloads=tuple(shm), ends_stream=truncate is not None, tensors=arrays)


def send_frame_bytes(sock: socket.socket, frame: BuiltFrame) -> None:
    """Write the frame (its memory files ride on the first bytes as SCM_RIGHTS), then end the
    stream if the frame is truncated. A receiver that hangs up early is not an error here: what it
    answered (or that it closed) is what the case checks."""
    fds = memory_files(frame.shm_payloads)
    try:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        view = memoryview(frame.data)
        while True:
            sent = sock.sendmsg([view], ancillary)
            ancillary = []
            view = view[sent:]
            if not view:
                break
        if frame.ends_stream:
            sock.shutdown(socket.SHUT_WR)
    except OSError:  # the receiver hung up or stopped reading: its answer (or silence) is judged
        pass
    finally:
        for fd in fds:
            os.close(fd)


def memory_files(payloads: tuple[bytes, ...]) -> list[int]:
    """Anonymous memory files holding `payloads` (the caller closes the descriptors)."""
    fds = []
    try:
        for data in payloads:
            fd = os.memfd_create("omnigraph-conformance", os.MFD_CLOEXEC)
            fds.append(fd)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _header_bytes(send: Mapping[str, Any], session: Mapping[str, Any], descriptors: list[dict[str, Any]]) -> bytes:
    if "header_text" in send:
        return send["header_text"].encode("utf-8", "surrogatepass")
    body = dict(send.get("body", {}))
    if "header_padding" in send:
        body["padding"] = "x" * send["header_padding"]
    header: dict[str, Any] = {
        "v": WIRE_VERSION,
        "type": send.get("message", "run"),
        "request_id": session["request_id"],
        "stage_id": session["stage_id"],
        "epoch": session["epoch"],
        "generation": session["generation"],
        "instance": session["instance"],
        "features_required": ["shm_fd"] if any("fd" in d for d in descriptors) else [],
        "tensors": descriptors,
        "body": body,
    }
    header.update(send.get("header", {}))
    for key in send.get("header_remove", []):
        header.pop(key, None)
    return json.dumps(header, separators=(",", ":")).encode()


def _binary_header_bytes(send: Mapping[str, Any], session: Mapping[str, Any], descriptors: list[dict[str, Any]],
                         binary_fields: list[dict[str, Any]], *, where: str) -> bytes:
    """The binary header of the wire docstring, from the case's descriptors and overrides."""
    if any("fd" in d for d in descriptors):
        raise FixtureInvalid(f"{where}: a binary header carries inline tensors only")
    request_id, instance = str(session["request_id"]).encode(), str(session["instance"]).encode()
    fixed = {"type": _BINARY_TYPES.get(send.get("message", "run"), 0), "tensor_count": len(descriptors),
             "stage_id": session["stage_id"], "epoch": session["epoch"], "generation": session["generation"]}
    fixed.update(send.get("binary", {}))
    parts = [_BINARY_FIXED.pack(fixed["type"], fixed["tensor_count"], len(request_id), len(instance), fixed["stage_id"],
                                fixed["epoch"], fixed["generation"]), request_id, instance]
    codes = {name: code for code, name in enumerate(WIRE_DTYPES)}
    for descriptor, overrides in zip(descriptors, binary_fields):
        name = descriptor["name"].encode()
        fields = {"dtype_code": codes.get(descriptor["dtype"], 255), "rank": len(descriptor["shape"]),
                  "name_length": len(name), "nbytes": descriptor["nbytes"]}
        fields.update(overrides)
        parts += [_BINARY_TENSOR.pack(fields["dtype_code"], fields["rank"], fields["name_length"], fields["nbytes"]),
                  struct.pack(f"<{len(descriptor['shape'])}Q", *descriptor["shape"]), name]
    return b"".join(parts)
