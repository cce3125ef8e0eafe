"""The frame codec: round trips (inline and shared memory) and refusals before any payload read."""

from __future__ import annotations

import json
import os
import select
import socket
import struct
from typing import Any

import numpy as np
import pytest

from omnigraph.workers import wire

CAP = 1 << 20


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.settimeout(2.0)  # a decoder that waited for a payload would fail the test, not hang it
    yield a, b
    a.close()
    b.close()


def open_fds() -> set[str]:
    """This process's open descriptors (the listing's own descriptor included: compare two calls
    made with the same set open)."""
    return set(os.listdir("/proc/self/fd"))


def header(**overrides: Any) -> dict[str, Any]:
    base = {
        "v": wire.WIRE_VERSION, "type": "run", "request_id": "r", "stage_id": 0, "epoch": 0,
        "generation": 1, "instance": "i", "features_required": [], "tensors": [], "body": {},
    }
    base.update(overrides)
    return base


def raw_frame(head: dict[str, Any] | bytes, payload_len: int, *, version: int = wire.WIRE_VERSION,
              magic: bytes = wire.MAGIC, header_len: int | None = None) -> bytes:
    head_bytes = head if isinstance(head, bytes) else json.dumps(head).encode()
    length = len(head_bytes) if header_len is None else header_len
    return wire.PREFIX.pack(magic, version, 0, length, payload_len, 0) + head_bytes


def f32(name: str, shape: list[int], offset: int = 0, **extra: Any) -> dict[str, Any]:
    desc = {"name": name, "dtype": "float32", "shape": shape, "nbytes": int(np.prod(shape)) * 4, "offset": offset}
    desc.update(extra)
    return desc


def test_round_trip_every_dtype_inline(pair):
    a, b = pair
    tensors = {
        "b": np.array([True, False, True]),
        "i8": np.arange(-3, 3, dtype=np.int8),
        "i16": np.arange(5, dtype=np.int16).reshape(5, 1),
        "i32": np.arange(7, dtype=np.int32),
        "i64": np.arange(12, dtype=np.int64).reshape(3, 4),
        "u8": np.arange(9, dtype=np.uint8).reshape(3, 3),
        "f16": np.linspace(0, 1, 6, dtype=np.float16),
        "f32": np.float32(3.5) * np.ones((), np.float32),  # rank 0
        "f64": np.linspace(0, 1, 11),
        "empty": np.zeros((0, 4), np.float32),
        "strided": np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2],  # not contiguous
        "big": np.random.default_rng(0).standard_normal((100, 100)).astype(np.float32),  # fits the socket's buffer
    }
    before = open_fds()
    wire.send_frame(a, "run", request_id="req-1", stage_id=2, epoch=3, generation=4, instance="abc",
                    body={"k": [1, "x"]}, tensors=tensors, max_payload_bytes=CAP)
    frame, arrays = wire.recv_message(b, max_payload_bytes=CAP)
    assert (frame.type, frame.request_id, frame.stage_id, frame.epoch, frame.generation, frame.instance) == ("run", "req-1", 2, 3, 4, "abc")
    assert frame.body == {"k": [1, "x"]}
    assert frame.features_required == () and all(d.fd is None for d in frame.tensors)  # inline, always
    assert list(arrays) == list(tensors)
    for name, expected in tensors.items():
        assert arrays[name].dtype == expected.dtype and arrays[name].shape == expected.shape, name
        np.testing.assert_array_equal(arrays[name], expected)
        assert arrays[name].ctypes.data % 16 == 0 or arrays[name].nbytes == 0, name  # aligned for any dtype
    del arrays
    assert open_fds() == before


def test_bfloat16_travels_as_raw_bits(pair):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a, b = pair
    values = np.array([1.0, -2.5, 3.0], dtype=ml_dtypes.bfloat16)
    for binary in (False, True):
        wire.send_frame(a, "run", tensors={"h": values}, max_payload_bytes=CAP, binary=binary)
        frame, arrays = wire.recv_message(b, max_payload_bytes=CAP)
        assert frame.binary == binary and frame.tensors[0].dtype == "bfloat16"
        assert arrays["h"].dtype == np.uint16
        np.testing.assert_array_equal(arrays["h"].view(ml_dtypes.bfloat16), values)


def test_encoder_refuses_what_the_wire_does_not_carry(pair):
    a, _ = pair
    with pytest.raises(wire.UnknownDtype) as info:
        wire.send_frame(a, "run", tensors={"u": np.zeros(2, np.uint16)}, max_payload_bytes=CAP)
    assert info.value.code == "unknown_dtype"
    with pytest.raises(wire.PayloadTooLarge):
        wire.send_frame(a, "run", tensors={"x": np.zeros(CAP, np.uint8), "y": np.zeros(1, np.uint8)}, max_payload_bytes=CAP)
    with pytest.raises(wire.MalformedHeader):
        wire.send_frame(a, "bogus", max_payload_bytes=CAP)
    for field, value in (("stage_id", True), ("epoch", np.int64(1)), ("generation", -1)):
        with pytest.raises(wire.MalformedHeader, match=field):
            wire.send_frame(a, "run", max_payload_bytes=CAP, **{field: value})
    with pytest.raises(wire.MalformedHeader, match="string"):
        wire.send_frame(a, "run", request_id=7, max_payload_bytes=CAP)  # type: ignore[arg-type]
    pair[1].setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing was sent for any refused frame
        pair[1].recv(1)


def test_the_header_is_compact_json_in_field_order(pair):
    """The encoder writes the header field by field: the bytes must be exactly those of
    json.dumps(header, separators=(",", ":")) (ASCII escapes, keys in the documented order)."""
    a, b = pair
    tensors = {"x\u00e9\"": np.ones((2, 3), np.float32), "empty": np.zeros((0, 4), np.int64), "s": np.bool_(True)}
    wire.send_frame(a, "run", request_id="r\u00e9\n\"\\", stage_id=3, epoch=2**63 - 1, generation=5,
                    instance="\U0001f600", body={"k": [1, 2.5, None, "v"]}, tensors=tensors, max_payload_bytes=CAP)
    prefix = b.recv(wire.PREFIX_BYTES)
    header_bytes = b.recv(wire.PREFIX.unpack(prefix)[3])
    decoded = json.loads(header_bytes)
    assert list(decoded) == ["v", "type", "request_id", "stage_id", "epoch", "generation", "instance",
                             "features_required", "tensors", "body"]
    assert header_bytes == json.dumps(decoded, separators=(",", ":")).encode()
    assert [d["name"] for d in decoded["tensors"]] == list(tensors)
    assert decoded["tensors"][2] == {"name": "s", "dtype": "bool", "shape": [], "nbytes": 1, "offset": 64}


MALFORMED = [
    # (case, header (or raw header bytes), payload length, expected code)
    ("header length over the cap", {"header_len": wire.MAX_HEADER_BYTES + 1}, 0, "header_too_large"),
    ("zero header length", {"header_len": 0}, 0, "header_too_large"),
    ("payload over the cap", header(), CAP + 1, "payload_too_large"),
    ("bad magic", {"magic": b"HTTP"}, 0, "bad_magic"),
    ("future version", {"version": 2}, 0, "unsupported_version"),
    ("header version differs", header(v=7), 0, "unsupported_version"),
    ("not JSON", b"{not json", 0, "malformed_header"),
    ("NaN", b'{"v": NaN}', 0, "malformed_header"),
    ("duplicate key", b'{"v": 1, "v": 1}', 0, "malformed_header"),
    ("not an object", b"[1, 2]", 0, "malformed_header"),
    ("field missing", {k: v for k, v in header().items() if k != "epoch"}, 0, "malformed_header"),
    ("unknown field", header(extra=1), 0, "malformed_header"),
    ("bool epoch", header(epoch=True), 0, "malformed_header"),
    ("negative epoch", header(epoch=-1), 0, "malformed_header"),
    ("unknown type", header(type="exec"), 0, "malformed_header"),
    ("unknown required feature", header(features_required=["zstd"]), 0, "unknown_required_feature"),
    ("unknown dtype", header(tensors=[{**f32("x", [2]), "dtype": "complex64"}]), 64, "unknown_dtype"),
    ("uint16 is not on the wire", header(tensors=[{**f32("x", [2]), "dtype": "uint16", "nbytes": 4}]), 64, "unknown_dtype"),
    ("nbytes disagrees with shape", header(tensors=[{**f32("x", [2, 2]), "nbytes": 12}]), 64, "byte_length_mismatch"),
    ("duplicate tensor name", header(tensors=[f32("x", [2]), f32("x", [2], offset=64)]), 128, "duplicate_tensor_name"),
    ("negative dim", header(tensors=[{**f32("x", [2]), "shape": [-2, 2], "nbytes": 16}]), 64, "bad_shape"),
    ("huge dim", header(tensors=[{**f32("x", [2]), "shape": [2**40], "nbytes": 2**42}]), 64, "bad_shape"),
    ("huge product", header(tensors=[{**f32("x", [2]), "shape": [2**30, 2**30], "nbytes": 2**62}]), 64, "payload_too_large"),
    ("rank over the cap", header(tensors=[{**f32("x", [2]), "shape": [1] * 9, "nbytes": 4}]), 64, "bad_shape"),
    ("float dim", header(tensors=[{**f32("x", [2]), "shape": [2.0]}]), 64, "bad_shape"),
    ("offset past the payload", header(tensors=[f32("x", [2], offset=64)]), 64, "bad_extent"),
    ("unaligned offset", header(tensors=[f32("x", [2], offset=8)]), 128, "bad_extent"),
    ("overlapping tensors", header(tensors=[f32("x", [20]), f32("y", [2], offset=64)]), 192, "bad_extent"),
    ("payload longer than the tensors", header(tensors=[f32("x", [2])]), 128, "byte_length_mismatch"),
    ("fd reference without fds", header(tensors=[{**{k: v for k, v in f32("x", [2]).items() if k != "offset"}, "fd": 0}]), 0, "bad_shm_reference"),
    ("offset and fd", header(tensors=[{**f32("x", [2]), "fd": 0}]), 64, "malformed_header"),
    ("too many tensors", header(tensors=[f32(f"x{i}", [1], offset=64 * i) for i in range(wire.MAX_TENSORS + 1)]), 64 * (wire.MAX_TENSORS + 1), "too_many_tensors"),
]


@pytest.mark.parametrize("case,head,payload_len,code", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_frames_are_refused_before_the_payload(pair, monkeypatch, case, head, payload_len, code):
    """The decoder raises having read only prefix + header: the payload bytes stay on the stream
    (and no payload buffer was allocated: read_payload is never reached)."""
    a, b = pair
    prefix_args = {}
    if isinstance(head, dict) and set(head) <= {"header_len", "magic", "version"}:
        prefix_args, head = head, header()
    data = raw_frame(head, payload_len, **prefix_args)
    payload = bytes(range(256)) * (min(payload_len, 4096) // 256 + 1)
    payload = payload[:min(payload_len, 4096)]
    a.sendall(data + payload)
    monkeypatch.setattr(wire, "read_payload", lambda *args: pytest.fail("payload read for a refused frame"))
    with pytest.raises(wire.WireError) as info:
        wire.read_frame(b, max_payload_bytes=CAP)
    assert info.value.code == code, str(info.value)
    assert type(info.value) is wire.WIRE_ERRORS[code]
    unread = b.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT) if payload else b""
    assert unread.endswith(payload)  # not one payload byte was consumed
    if info.value.pending_payload_bytes is not None:  # the header was read whole: only the payload is left
        assert info.value.pending_payload_bytes == payload_len and unread == payload


def test_a_refused_frame_with_sound_lengths_leaves_the_stream_in_sync(pair):
    a, b = pair
    bad = header(tensors=[{**f32("x", [2, 2]), "nbytes": 12}])
    a.sendall(raw_frame(bad, 64) + bytes(64))
    wire.send_frame(a, "stats", request_id="next", max_payload_bytes=CAP)
    with pytest.raises(wire.ByteLengthMismatch) as info:
        wire.read_frame(b, max_payload_bytes=CAP)
    wire.discard_payload(b, info.value.pending_payload_bytes)
    frame, _ = wire.recv_message(b, max_payload_bytes=CAP)
    assert (frame.type, frame.request_id) == ("stats", "next")


def test_a_refused_prefix_says_the_stream_is_lost(pair):
    a, b = pair
    a.sendall(raw_frame(header(), 0, magic=b"XXXX"))
    with pytest.raises(wire.BadMagic) as info:
        wire.read_frame(b, max_payload_bytes=CAP)
    assert info.value.pending_payload_bytes is None


def test_truncated_payload_and_clean_close(pair):
    a, b = pair
    a.sendall(raw_frame(header(tensors=[f32("x", [16])]), 64) + bytes(10))
    a.shutdown(socket.SHUT_WR)
    frame = wire.read_frame(b, max_payload_bytes=CAP)
    with pytest.raises(wire.TruncatedFrame) as info:
        wire.read_payload(b, frame)
    assert info.value.code == "truncated_frame"
    with pytest.raises(wire.PeerClosed):
        wire.read_frame(b, max_payload_bytes=CAP)


def test_truncated_prefix_and_header(pair):
    a, b = pair
    a.sendall(raw_frame(header(), 0)[: wire.PREFIX_BYTES + 5])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(wire.TruncatedFrame):
        wire.read_frame(b, max_payload_bytes=CAP)


def test_shared_memory_of_the_wrong_size_is_refused_and_closed(pair):
    a, b = pair
    before = open_fds()
    fd = os.memfd_create("t")
    os.ftruncate(fd, 100)
    desc = {"name": "x", "dtype": "float32", "shape": [16], "nbytes": 64, "fd": 0}
    data = raw_frame(header(tensors=[desc], features_required=["shm_fd"]), 0)
    a.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
    os.close(fd)
    with pytest.raises(wire.ByteLengthMismatch):
        wire.read_frame(b, max_payload_bytes=CAP)
    assert open_fds() == before  # the received descriptor was closed too


def test_unreferenced_descriptors_are_refused(pair):
    a, b = pair
    fd = os.memfd_create("t")
    a.sendmsg([raw_frame(header(), 0)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])
    os.close(fd)
    with pytest.raises(wire.BadShmReference):
        wire.read_frame(b, max_payload_bytes=CAP)


def test_error_codes_are_stable():
    assert sorted(wire.WIRE_ERRORS) == sorted([
        "bad_magic", "unsupported_version", "header_too_large", "payload_too_large", "malformed_header",
        "unknown_required_feature", "unknown_dtype", "bad_shape", "byte_length_mismatch", "bad_extent",
        "bad_shm_reference", "duplicate_tensor_name", "too_many_tensors", "truncated_frame", "stale_epoch",
        "stale_generation", "stale_instance",
    ])
    for code, cls in wire.WIRE_ERRORS.items():
        assert code in wire.__doc__, code
        assert issubclass(cls, wire.WireError)


def test_binary_header_round_trip_and_fallbacks(pair):
    """`binary=True` sends run/result frames with the binary header; anything it cannot carry
    (a body, another message type) goes with the JSON header."""
    a, b = pair
    tensors = {"ids": np.arange(6, dtype=np.int64).reshape(2, 3), "mask": np.array([True, False]),
               "x": np.linspace(0, 1, 5, dtype=np.float32)}
    wire.send_frame(a, "run", request_id="r1", stage_id=2, epoch=5, generation=3, instance="abc",
                    tensors=tensors, max_payload_bytes=CAP, binary=True)
    frame, arrays = wire.recv_message(b, max_payload_bytes=CAP)
    assert frame.binary and (frame.type, frame.request_id, frame.stage_id, frame.epoch, frame.generation,
                             frame.instance, frame.body) == ("run", "r1", 2, 5, 3, "abc", {})
    for name, array in tensors.items():
        assert arrays[name].dtype == array.dtype and np.array_equal(arrays[name], array)

    wire.send_frame(a, "result", body={"note": 1}, tensors=tensors, max_payload_bytes=CAP, binary=True)
    wire.send_frame(a, "stats", max_payload_bytes=CAP, binary=True)
    for expected in ("result", "stats"):
        frame, _ = wire.recv_message(b, max_payload_bytes=CAP)
        assert frame.type == expected and not frame.binary


def test_binary_frames_follow_each_call_s_own_tensors(pair):
    """The binary encoder remembers tensor layouts by (name, dtype, shape): the same names with
    another shape or dtype, a transposed (non-contiguous) view and plain lists each arrive as sent."""
    a, b = pair
    calls = [
        {"x": np.arange(6, dtype=np.float32).reshape(2, 3)},
        {"x": np.arange(6, dtype=np.float32).reshape(3, 2)},
        {"x": np.arange(6, dtype=np.int64).reshape(3, 2)},
        {"x": np.arange(6, dtype=np.float32).reshape(2, 3).T},
        {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "y": np.zeros(0, np.int8)},
        {"x": [[1.5, 2.5]]},
    ]
    for tensors in calls:
        wire.send_frame(a, "result", request_id="r", tensors=tensors, max_payload_bytes=CAP, binary=True)
        frame, arrays = wire.recv_message(b, max_payload_bytes=CAP)
        assert frame.binary and list(arrays) == list(tensors)
        for name, sent in tensors.items():
            sent = np.asarray(sent)
            assert arrays[name].dtype == sent.dtype and np.array_equal(arrays[name], sent)


def test_the_binary_encoder_refuses_what_the_receiver_would(pair):
    a, b = pair
    with pytest.raises(wire.PayloadTooLarge):  # 100 bytes take 128 on the wire, above a cap of 120
        wire.send_frame(a, "run", tensors={"x": np.zeros(100, np.uint8)}, max_payload_bytes=120, binary=True)
    with pytest.raises(wire.UnknownDtype):
        wire.send_frame(a, "run", tensors={"x": np.zeros(2, np.uint16)}, max_payload_bytes=CAP, binary=True)
    with pytest.raises(wire.BadShape):
        wire.send_frame(a, "run", tensors={"x": np.zeros([1] * 9, np.float32)}, max_payload_bytes=CAP, binary=True)
    with pytest.raises(wire.TooManyTensors):
        wire.send_frame(a, "run", tensors={f"x{i}": np.zeros(1, np.int8) for i in range(wire.MAX_TENSORS + 1)},
                        max_payload_bytes=CAP, binary=True)
    with pytest.raises(wire.MalformedHeader):
        wire.send_frame(a, "run", request_id="r" * 257, tensors={"x": np.zeros(1, np.int8)}, max_payload_bytes=CAP,
                        binary=True)
    with pytest.raises(wire.MalformedHeader):
        wire.send_frame(a, "run", epoch=True, tensors={"x": np.zeros(1, np.int8)}, max_payload_bytes=CAP, binary=True)
    assert not select.select([b], [], [], 0)[0]  # nothing at all was sent


def test_a_remembered_binary_section_is_still_checked_against_its_frame(pair):
    """Valid tensor sections are remembered by their bytes; a frame reusing one with a payload of
    another length, or a section with one byte changed, is refused as if never seen."""
    a, b = pair
    wire.send_frame(a, "run", tensors={"x": np.zeros((2, 3), np.float32)}, max_payload_bytes=CAP, binary=True)
    frame_bytes = b.recv(65536)  # the whole frame as sent
    a.sendall(frame_bytes)
    wire.recv_message(b, max_payload_bytes=CAP)  # accepted: its section is now remembered

    magic, version, flags, header_len, payload_len, reserved = wire.PREFIX.unpack_from(frame_bytes)
    longer = wire.PREFIX.pack(magic, version, flags, header_len, payload_len + 64, reserved)
    a.sendall(longer + frame_bytes[wire.PREFIX_BYTES:] + bytes(64))
    with pytest.raises(wire.ByteLengthMismatch) as refused:
        wire.read_frame(b, max_payload_bytes=CAP)
    wire.discard_payload(b, refused.value.pending_payload_bytes)

    fixed = struct.calcsize("<BBHHQQQ")  # then the (empty) request id and instance, then the tensor
    broken = bytearray(frame_bytes)
    broken[wire.PREFIX_BYTES + fixed] = 250  # the tensor's dtype code
    a.sendall(bytes(broken))
    with pytest.raises(wire.UnknownDtype):
        wire.read_frame(b, max_payload_bytes=CAP)


def test_spin_wait_returns_when_a_message_is_there_and_consumes_nothing(pair):
    a, b = pair
    a.sendall(b"next message")
    wire.SpinWait(b, 100_000)()  # returns at once: the bytes are there
    assert b.recv(64, socket.MSG_DONTWAIT) == b"next message"


def test_spin_wait_gives_up_after_its_bound_and_on_a_closed_peer(pair):
    a, b = pair
    b.settimeout(None)  # a blocking socket: MSG_DONTWAIT reports "nothing yet" instead of waiting
    wire.SpinWait(b, 1000)()  # nothing comes: returns after about a millisecond, leaving the socket empty
    with pytest.raises(BlockingIOError):
        b.recv(1, socket.MSG_DONTWAIT)
    a.close()
    wire.SpinWait(b, 100_000)()  # the hang-up ends the wait, and the read that follows sees the end
    assert b.recv(1) == b""
