"""The worker command spoken to frame by frame, as a conformance runner does: malformed frames get
error frames with the wire code; the worker goes on while the stream is in sync."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest

from omnigraph.workers import wire
from omnigraph.workers.route import WorkerRoute
from omnigraph.workers.worker import EXIT_WIRE_DESYNC

from .conftest import pack_graph

CAP = 1 << 20


@pytest.fixture
def raw_worker(tmp_path: Path):
    """A worker process connected to a socket the test holds, with its hello already read."""
    path = tmp_path / "w.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    route = WorkerRoute(name="raw", interpreter=sys.executable, max_io_bytes=CAP)
    process = subprocess.Popen([sys.executable, "-m", "omnigraph.workers.worker", "--connect", str(path),
                                "--generation", "7", "--route", route.to_json()])
    listener.settimeout(60)
    sock, _ = listener.accept()
    listener.close()
    sock.settimeout(30)
    hello, _ = wire.recv_message(sock, max_payload_bytes=CAP)
    assert hello.type == "hello" and hello.generation == 7
    yield sock, hello.instance, process
    sock.close()
    process.wait(10)


def frame_bytes(worker_instance: str, **overrides) -> bytes:
    head = {"v": 1, "type": "stats", "request_id": "q", "stage_id": 0, "epoch": 0, "generation": 7,
            "instance": worker_instance, "features_required": [], "tensors": [], "body": {}}
    head.update(overrides)
    data = json.dumps(head).encode()
    payload_len = sum(-(-t["nbytes"] // 64) * 64 for t in head["tensors"])
    return wire.PREFIX.pack(wire.MAGIC, 1, 0, len(data), payload_len, 0) + data + bytes(payload_len)


def reply(sock: socket.socket) -> wire.Frame:
    frame, _ = wire.recv_message(sock, max_payload_bytes=CAP)
    return frame


@pytest.mark.parametrize("overrides,code", [
    ({"tensors": [{"name": "x", "dtype": "float32", "shape": [2, 2], "nbytes": 12, "offset": 0}]}, "byte_length_mismatch"),
    ({"tensors": [{"name": "x", "dtype": "complex64", "shape": [2], "nbytes": 16, "offset": 0}]}, "unknown_dtype"),
    ({"tensors": [{"name": "x", "dtype": "int8", "shape": [1], "nbytes": 1, "offset": 0},
                  {"name": "x", "dtype": "int8", "shape": [1], "nbytes": 1, "offset": 64}]}, "duplicate_tensor_name"),
    ({"tensors": [{"name": "x", "dtype": "int8", "shape": [-1], "nbytes": 1, "offset": 0}]}, "bad_shape"),
    ({"features_required": ["compression"]}, "unknown_required_feature"),
    ({"generation": 6}, "stale_generation"),
    ({"instance": "someone-else"}, "stale_instance"),
    ({"type": "result"}, "unexpected_message"),
])
def test_refused_frames_get_their_code_and_the_worker_goes_on(raw_worker, overrides, code):
    sock, instance, process = raw_worker
    sock.sendall(frame_bytes(instance, **overrides))
    refused = reply(sock)
    assert refused.type == "error" and refused.body["code"] == code, refused.body
    sock.sendall(frame_bytes(instance))
    assert reply(sock).type == "stats_result"
    assert process.poll() is None


def test_stale_epoch_after_a_higher_one(raw_worker):
    sock, instance, _ = raw_worker
    sock.sendall(frame_bytes(instance, type="fence", epoch=4))  # never answered
    sock.sendall(frame_bytes(instance, epoch=3))
    assert reply(sock).body["code"] == "stale_epoch"
    sock.sendall(frame_bytes(instance, epoch=4))
    assert reply(sock).body["max_epoch"] == 4


def test_a_broken_prefix_ends_the_connection(raw_worker):
    sock, instance, process = raw_worker
    sock.sendall(wire.PREFIX.pack(wire.MAGIC, 1, 0, wire.MAX_HEADER_BYTES + 1, 0, 0))
    assert reply(sock).body["code"] == "header_too_large"
    assert process.wait(10) == EXIT_WIRE_DESYNC


def test_close_is_answered_and_the_worker_exits(raw_worker):
    sock, instance, process = raw_worker
    wire.send_frame(sock, "close", generation=7, instance=instance, max_payload_bytes=CAP)
    assert reply(sock).type == "closing"
    assert process.wait(10) == 0


def test_outputs_over_the_cap_are_refused_not_sent(raw_worker, tmp_path):
    sock, instance, process = raw_worker
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"])
    y = oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["m"])
    doubling = oh.make_model(oh.make_graph([oh.make_node("Concat", ["x", "x"], ["y"], axis=0)], "double", [x], [y]),
                             opset_imports=[oh.make_opsetid("", 17)], ir_version=10)
    bundle = pack_graph(tmp_path / "double", doubling, {"x": np.ones(4, np.float32)})
    wire.send_frame(sock, "load", generation=7, instance=instance, body={"manifest_path": str(bundle.manifest_path)},
                    max_payload_bytes=CAP)
    assert reply(sock).type == "loaded"
    fits = np.ones(CAP // 8, np.float32)  # 512 KiB in, 1 MiB out
    wire.send_frame(sock, "run", generation=7, instance=instance, tensors={"x": fits}, max_payload_bytes=CAP)
    assert reply(sock).type == "result"
    wire.send_frame(sock, "run", generation=7, instance=instance, tensors={"x": np.ones(CAP // 8 + 1, np.float32)},
                    max_payload_bytes=CAP)
    refused = reply(sock)
    assert refused.body["code"] == "outputs_not_sent" and refused.body["message"].startswith("payload_too_large: ")
    assert process.poll() is None
