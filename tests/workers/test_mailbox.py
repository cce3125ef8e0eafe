"""The mailbox: frames through shared memory beside the socket, one doorbell per side."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading
import time

import numpy as np
import pytest

from omnigraph.workers import mailbox as mailbox_module
from omnigraph.workers import wire
from omnigraph.workers.errors import RemoteError, WorkerDied
from omnigraph.workers.mailbox import FEATURE_MAILBOX, Mailbox, MailboxUnavailable

from .conftest import affine_inputs

CAP = 1 << 20


@pytest.fixture
def pair():
    """Both sides of one mailbox in this process, and the socket pair their hang-ups show on."""
    controller = Mailbox.create(64 * 1024)
    worker = Mailbox.attach(os.dup(controller.fd))
    controller.close_fd()
    ours, theirs = socket.socketpair()
    yield controller, worker, ours, theirs
    ours.close()
    theirs.close()


def write(area, tensors, **fields):
    fields = {"request_id": "r1", "stage_id": 0, "epoch": 3, "generation": 2, "instance": "i" * 32, **fields}
    return wire.write_binary_frame(area, "run", tensors=tensors, max_payload_bytes=CAP, **fields)


def test_a_frame_in_the_mailbox_reads_back_as_sent():
    mailbox = Mailbox.create(64 * 1024)
    tensors = {"x": np.arange(12, dtype=np.float32).reshape(3, 4), "ids": np.array([[1, 2, 3]], np.int64),
               "mask": np.array([True, False]), "half": np.ones((2, 1), np.float16), "scalar": np.array(7, np.int32),
               "empty": np.zeros((0, 5), np.float32), "strided": np.arange(10, dtype=np.int64)[::2]}
    length = write(mailbox.outbox, tensors)
    frame, arrays = wire.read_binary_frame(mailbox.outbox, length, max_payload_bytes=CAP)
    assert (frame.type, frame.request_id, frame.epoch, frame.generation, frame.binary) == ("run", "r1", 3, 2, True)
    assert arrays.keys() == tensors.keys()
    for name, array in tensors.items():
        assert arrays[name].dtype == array.dtype and arrays[name].shape == array.shape
        np.testing.assert_array_equal(arrays[name], array)
    write(mailbox.outbox, {"x": np.zeros((3, 4), np.float32)})
    np.testing.assert_array_equal(arrays["x"], tensors["x"])  # the reader's arrays own their bytes


def test_a_frame_read_in_place_views_the_area_until_it_is_written_again():
    mailbox = Mailbox.create(64 * 1024)
    length = write(mailbox.outbox, {"x": np.arange(6, dtype=np.int64).reshape(2, 3)})
    _, arrays = wire.read_binary_frame(mailbox.outbox, length, max_payload_bytes=CAP, copy=False)
    np.testing.assert_array_equal(arrays["x"], [[0, 1, 2], [3, 4, 5]])
    write(mailbox.outbox, {"x": np.full((2, 3), 9, np.int64)})
    np.testing.assert_array_equal(arrays["x"], np.full((2, 3), 9))  # no copy: the worker answers first


def test_the_mailbox_frame_is_the_socket_frame_byte_for_byte():
    mailbox = Mailbox.create(64 * 1024)
    tensors = {"x": np.arange(5, dtype=np.float32)}
    length = write(mailbox.outbox, tensors)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        wire.send_frame(ours, "run", request_id="r1", epoch=3, generation=2, instance="i" * 32, tensors=tensors,
                        max_payload_bytes=CAP, binary=True)
        assert theirs.recv(length + 1) == bytes(mailbox.outbox[:length])


def test_what_the_mailbox_cannot_hold_goes_through_the_socket():
    mailbox = Mailbox.create(4096)
    assert write(mailbox.outbox, {"x": np.zeros(2048, np.float32)}) is None  # 8 KB: more than the area


def test_a_frame_the_receiver_would_refuse_is_refused_before_anything_is_written():
    mailbox = Mailbox.create(64 * 1024)
    before = bytes(mailbox.outbox[:256])
    with pytest.raises(wire.PayloadTooLarge):
        wire.write_binary_frame(mailbox.outbox, "run", request_id="r", stage_id=0, epoch=0, generation=0, instance="",
                                tensors={"x": np.zeros(1024, np.float32)}, max_payload_bytes=1024)
    with pytest.raises(wire.UnknownDtype):
        write(mailbox.outbox, {"x": np.zeros(4, np.uint16)})
    with pytest.raises(wire.MalformedHeader):
        write(mailbox.outbox, {"x": np.zeros(4, np.float32)}, request_id="r" * 300)
    with pytest.raises(wire.MalformedHeader):
        wire.write_binary_frame(mailbox.outbox, "load", request_id="", stage_id=0, epoch=0, generation=0, instance="",
                                tensors={}, max_payload_bytes=CAP)
    assert bytes(mailbox.outbox[:256]) == before


@pytest.mark.parametrize("tamper, error", [
    (lambda area, n: n + 1, wire.ByteLengthMismatch),                            # announced longer than written
    (lambda area, n: 4, wire.TruncatedFrame),                                    # shorter than a prefix
    (lambda area, n: 1 << 30, wire.TruncatedFrame),                              # beyond the area
    (lambda area, n: area.__setitem__(slice(0, 4), wire.MAGIC) or n, wire.BadMagic),  # a JSON frame
    (lambda area, n: area.__setitem__(slice(4, 6), b"\x09\x00") or n, wire.UnsupportedVersion),
    (lambda area, n: area.__setitem__(slice(12, 20), (2 * CAP).to_bytes(8, "little")) or n, wire.PayloadTooLarge),
    (lambda area, n: area.__setitem__(slice(92, 100), (999).to_bytes(8, "little")) or n, wire.ByteLengthMismatch),
])
def test_a_tampered_mailbox_frame_is_refused_with_its_wire_code(tamper, error):
    mailbox = Mailbox.create(64 * 1024)
    length = write(mailbox.outbox, {"x": np.zeros(8, np.float32)})
    with pytest.raises(error):
        wire.read_binary_frame(mailbox.outbox, tamper(mailbox.outbox, length), max_payload_bytes=CAP)


def test_each_post_says_whether_its_message_is_in_the_mailbox(pair):
    controller, worker, ours, _ = pair
    controller.announce(0)  # a message on the socket
    length = write(controller.outbox, {"x": np.ones(4, np.float32)})
    controller.announce(length)  # then one in the mailbox
    assert worker.receive(0, None, ours) == 0
    assert worker.receive(0, None, ours) == length
    worker.announce(0)
    assert controller.receive(0, None, ours) == 0


def test_a_frame_written_before_its_post_is_not_taken_for_an_earlier_message(pair):
    """A socket message is posted; the next call's frame lands in the mailbox before its own post:
    the first post still means the socket."""
    controller, worker, ours, _ = pair
    controller.announce(0)
    write(controller.outbox, {"x": np.ones(4, np.float32)})
    mailbox_module._SLOT.pack_into(controller._control, controller._out_slot, 2, 160)  # the next post's slot, not yet made
    assert worker.receive(0, None, ours) == 0


def test_a_wait_ends_at_its_deadline_or_when_the_peer_hangs_up(pair):
    controller, worker, ours, theirs = pair
    deadline = time.monotonic() + 0.1
    assert worker.receive(200, deadline, ours) is None
    assert time.monotonic() >= deadline  # not before it (how soon after is for benchmarks to say)
    controller.announce(0)
    theirs.close()  # the peer posted, then went: the post is still taken
    assert worker.receive(0, None, ours) == 0
    with pytest.raises(wire.PeerClosed):  # no deadline: only the hang-up ends this wait
        worker.receive(0, None, ours)


def test_a_file_that_is_not_a_mailbox_is_refused(tmp_path):
    fd = os.memfd_create("not-a-mailbox")
    os.ftruncate(fd, 3 * 4096)
    with pytest.raises(MailboxUnavailable, match="not an omnigraph mailbox"):
        Mailbox.attach(fd)
    with pytest.raises(ValueError):
        Mailbox.create(100)


def test_a_worker_serves_through_the_mailbox_and_the_socket_alike(start_worker, affine_bundle, cpu_route):
    client = start_worker(dataclasses.replace(cpu_route, mailbox_bytes=4096))
    assert FEATURE_MAILBOX in client.hello.features and client._mailbox is not None
    client.load(affine_bundle.manifest_path)
    small, large = affine_inputs(2, 4), affine_inputs(64, 64)  # 1 KB through the mailbox, 17 KB through the socket
    for inputs in (small, large, small):
        got = client.run(inputs, request_id="r", stage_id=0, epoch=0)
        np.testing.assert_array_equal(got["y"], np.maximum(inputs["x"], 0) * 2 - 1)
    assert client.stats()["runs"] == 3


def test_a_route_without_a_mailbox_keeps_every_frame_on_the_socket(start_worker, cpu_route):
    client = start_worker(dataclasses.replace(cpu_route, mailbox_bytes=0))
    assert FEATURE_MAILBOX not in client.hello.features and client._mailbox is None


def test_the_worker_refuses_a_bad_mailbox_frame_and_serves_on(start_worker, affine_bundle):
    client = start_worker()
    client.load(affine_bundle.manifest_path)
    mailbox = client._mailbox
    for fields, code in (({"generation": 0}, "stale_generation"), ({}, "bad_magic")):
        with client._send_lock:
            length = write(mailbox.outbox, affine_inputs(1, 4), instance=client.instance,
                           **{"generation": client.generation, **fields})
            if code == "bad_magic":
                mailbox.outbox[:4] = wire.MAGIC
            mailbox.announce(length)
        frame, _ = client._receive(None)
        assert frame.type == "error" and frame.body["code"] == code
    assert client.run(affine_inputs(1, 4), request_id="fresh", stage_id=0, epoch=0)["y"].shape == (1, 4)
    assert client.stats()["refused_frames"] == 2


def test_a_refused_call_leaves_the_mailbox_in_step(start_worker, affine_bundle):
    client = start_worker()
    client.load(affine_bundle.manifest_path)
    with pytest.raises(RemoteError, match="input_name_mismatch"):
        client.run({"x": np.ones((1, 4), np.float32)}, request_id="bad", stage_id=0, epoch=0)
    assert client.run(affine_inputs(1, 4), request_id="good", stage_id=0, epoch=0)["y"].shape == (1, 4)


def test_a_worker_whose_controller_goes_away_exits(start_worker):
    client = start_worker()
    client._sock.shutdown(socket.SHUT_RDWR)  # the controller's end closes, as when its process dies
    assert client.wait_exit(5.0) and client.returncode == 0


def test_close_lets_the_mailbox_go(start_worker, affine_bundle):
    client = start_worker()
    client.load(affine_bundle.manifest_path)
    client.run(affine_inputs(1, 4), request_id="r", stage_id=0, epoch=0)
    assert client.close() == 0 and client._mailbox is None


def _reply_on_the_loop(client, inputs, request_id):
    """Submit `via_socket` and take the reply in an event loop's reader on `reply_fd`."""
    async def call():
        loop = asyncio.get_running_loop()
        reply = loop.create_future()

        def readable():
            try:
                outputs = client.ready_result()
            except BaseException as exc:
                reply.set_exception(exc)
            else:
                if outputs is not None:
                    reply.set_result(outputs)

        client.submit(inputs, request_id=request_id, stage_id=0, epoch=0, via_socket=True)
        loop.add_reader(client.reply_fd, readable)
        try:
            return await asyncio.wait_for(reply, 30)
        finally:
            loop.remove_reader(client.reply_fd)

    return asyncio.run(call())


@pytest.mark.parametrize("mailbox_bytes", [4096, 0])
def test_a_call_sent_through_the_socket_is_answered_there_for_an_event_loop(start_worker, affine_bundle, cpu_route,
                                                                         mailbox_bytes):
    client = start_worker(dataclasses.replace(cpu_route, mailbox_bytes=mailbox_bytes))
    client.load(affine_bundle.manifest_path)
    inputs = affine_inputs(2, 4)
    for request_id in ("loop-1", "loop-2"):
        got = _reply_on_the_loop(client, inputs, request_id)
        np.testing.assert_array_equal(got["y"], np.maximum(inputs["x"], 0) * 2 - 1)
    # the doorbell stayed in step: calls through the mailbox and the blocking wait work after it
    assert client.run(inputs, request_id="thread", stage_id=0, epoch=0)["y"].shape == (2, 4)
    assert client.stats()["runs"] == 3


def test_an_event_loop_waiting_on_a_worker_that_dies_gets_worker_died(start_worker, slow_bundle):
    client = start_worker()
    client.load(slow_bundle.manifest_path)
    threading.Timer(0.3, client.kill).start()  # the slow graph runs for seconds at 4096 rows
    with pytest.raises(WorkerDied):
        _reply_on_the_loop(client, {"x": np.ones((4096, 1024), np.float32)}, "dies")
