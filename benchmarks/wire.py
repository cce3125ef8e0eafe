"""What the graph worker's wire costs: an identity graph run through a worker process vs the same
InferenceSession.run in process, for 4 KB, 1 MB and 64 MB tensors, each sent through the mailbox
(shared-memory areas and posix_ipc semaphores, workers/mailbox.py; the area sized to hold the
frame) and inline through the socket (the route's mailbox_bytes 0), to show whether the mailbox
pays its way and where mailbox_bytes belongs; the socket also with both ends sleeping at once
(spin_wait_us 0), to show what wire.SpinWait saves. The in-process session and every path are timed in alternating
blocks (ROUNDS of them), so a quiet or a busy minute of a shared machine shows in all of them.

    python benchmarks/wire.py [--json PATH] [--quick]
    python benchmarks/wire.py --phases [--json PATH]

Target: the worker adds at most 100 us (median) at 4 KB on the 2-core CPU machine.

`--phases` takes the 4 KB round trip apart, with no WorkerClient or worker loop in the way: a
forked child answers through the wire functions alone, both ends polling, (a) echoing the frame,
(b) running the worker's GraphSession on it, (c) the same with the tensor's 4 KB alone on the socket
(no prefix, header or checks: one recv_into a fixed buffer per side), and (d) running the same
GraphSession on a fixed array between two shared-memory counters that both ends spin on (no system
call on the path), (e) the same frames as (b) through the mailbox (shared memory and
semaphores, workers/mailbox.py), and (f) between (b) and (c): the same binary tensor section, behind a bare
prefix of two lengths, with nothing checked beyond a cache lookup of the section (the least any
self-describing framing in Python does per message). Each child
also times GraphSession.run in a tight loop of its own first ("quiet"), so the rows show what
alternating with the other process does to the same call.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import mmap
import platform
import os
import select
import shlex
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnx.helper as oh
import onnxruntime as ort

from omnigraph.bundles import pack_bundle
from omnigraph.workers.client import WorkerClient
from omnigraph.workers.mailbox import Mailbox
from omnigraph.workers import wire
from omnigraph.workers.route import DEFAULT_MAILBOX_BYTES, WorkerRoute
from omnigraph.workers.session import describe, load_session
from omnigraph.workers.wire import SPIN_WAIT_US

try:
    from benchmarks.machine import cpu_name
except ImportError:  # run as a script: this folder is sys.path[0]
    from machine import cpu_name

CASES = [("4KB", 4 * 1024, 5000), ("1MB", 1024 * 1024, 500), ("64MB", 64 * 1024 * 1024, 30)]
# (path, mailbox area for a tensor of n bytes, spin_wait_us): the mailbox and the socket with the
# default polling, and the socket with both ends sleeping at once (what polling saves), side by side.
PATHS = [("mailbox", lambda n: n + MAILBOX_HEADROOM, SPIN_WAIT_US),
         ("inline", lambda n: 0, SPIN_WAIT_US),
         ("inline-sleep", lambda n: 0, 0)]
MAILBOX_HEADROOM = 64 * 1024  # prefix, header and paddings around the tensor
ROUNDS = 10  # blocks per path, taken in turn (see interleaved_timings_us)
TARGET_OVERHEAD_US_4KB = 100.0


def identity_bundle(folder: Path):
    x = oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"])
    y = oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n"])
    graph = oh.make_graph([oh.make_node("Identity", ["x"], ["y"], name="identity")], "identity", [x], [y])
    folder.mkdir()
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)], ir_version=10), folder / "graph.onnx")
    np.savez(folder / "inputs.npz", x=np.ones(16, np.float32))
    return pack_bundle(folder, component="bench.identity", example_inputs_file="inputs.npz")


def timings_us(call, iterations: int) -> np.ndarray:
    for _ in range(max(3, iterations // 20)):  # warm caches and allocators
        call()
    samples = np.empty(iterations)
    for i in range(iterations):
        start = time.perf_counter_ns()
        call()
        samples[i] = (time.perf_counter_ns() - start) / 1000.0
    return samples


def interleaved_timings_us(calls: dict[str, Callable[[], object]], iterations: int) -> dict[str, np.ndarray]:
    """``iterations`` timings of each call, taken in ROUNDS blocks that visit the calls in turn, so
    that every call sees the same moments of a shared machine (a quiet or a busy minute shows in
    all of them, not in one)."""
    block = max(1, iterations // ROUNDS)
    samples: dict[str, list[np.ndarray]] = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            samples[name].append(timings_us(call, block))
    return {name: np.concatenate(blocks) for name, blocks in samples.items()}


def socket_floor_us(nbytes: int, iterations: int) -> np.ndarray:
    """A bare echo of ``nbytes`` between two processes over a Unix socket pair: what the machine
    charges for any round trip before a byte of framing (the floor under the worker's overhead)."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the echo process
        ours.close()
        while data := theirs.recv(1 << 20):
            theirs.sendall(data)
        os._exit(0)
    theirs.close()
    ours.setblocking(False)
    message = bytes(nbytes)

    def round_trip() -> None:  # send and receive together: the echo cannot buffer 64 MB
        view, sent, received = memoryview(message), 0, 0
        while received < nbytes:
            readable, writable, _ = select.select([ours], [ours] if sent < nbytes else [], [])
            if writable:
                sent += ours.send(view[sent:])
            if readable:
                received += len(ours.recv(1 << 20))

    try:
        return timings_us(round_trip, iterations)
    finally:
        ours.close()
        os.waitpid(pid, 0)


def codec_cpu_us(nbytes: int, iterations: int) -> tuple[float, float]:
    """CPU time (this thread) to encode and to decode one run frame of one ``nbytes`` tensor."""
    sender, receiver = socket.socketpair()
    tensors = {"x": np.ones(nbytes // 4, np.float32)}
    encode = decode = 0
    try:
        for _ in range(iterations):
            start = time.thread_time_ns()
            wire.send_frame(sender, "run", request_id="bench", epoch=1, generation=1, instance="0" * 32,
                            tensors=tensors, max_payload_bytes=2 * nbytes)
            middle = time.thread_time_ns()
            wire.recv_message(receiver, max_payload_bytes=2 * nbytes)
            encode += middle - start
            decode += time.thread_time_ns() - middle
    finally:
        sender.close()
        receiver.close()
    return encode / iterations / 1000.0, decode / iterations / 1000.0


def _spin_until_changed(counters: np.ndarray, index: int, seen: int) -> int:
    while counters[index] == seen:
        pass
    return int(counters[index])


# --phases: (name, transport, runs the GraphSession). Transports: "codec" (wire frames through the
# socket), "mailbox" (the same frames through the mailbox), "minimal" (see _MinimalFraming), "raw" (the tensor's 4 KB alone through the socket: no
# prefix, header or checks, one recv_into a fixed buffer per side), "counters" (shared-memory
# counters, no system call).
PHASES = [("socket echo", "codec", False), ("socket + GraphSession.run", "codec", True),
          ("mailbox + GraphSession.run", "mailbox", True),
          ("minimal framing + GraphSession.run", "minimal", True),
          ("raw socket, no codec + GraphSession.run", "raw", True),
          ("shared-memory counters + GraphSession.run", "counters", True)]


class _MinimalFraming:
    """The least a self-describing framing costs in Python: a 16-byte prefix (section and payload
    lengths), the wire's binary tensor section, the payload; the receiver reads the prefix, then
    the rest in one call, looks the section up in a cache (parsed and checked once) and views a
    copy of the payload. No ids, epochs or per-message checks: a floor under the codec, not a wire."""

    PREFIX = struct.Struct("<QQ")

    def __init__(self, sock: socket.socket, max_payload_bytes: int) -> None:
        self._sock = sock
        self._limit = max_payload_bytes
        self._buffer = np.empty(max_payload_bytes, np.uint8)
        self._view = memoryview(self._buffer)
        self._sections: dict[bytes, tuple[wire.TensorDescriptor, ...]] = {}

    def send(self, tensors: dict[str, np.ndarray]) -> None:
        layout = wire._binary_layout(tensors)
        self._sock.sendmsg([self.PREFIX.pack(len(layout.section), layout.payload_nbytes) + layout.section,
                            *tensors.values()])

    def receive(self) -> dict[str, np.ndarray] | None:
        """The next message's arrays; None once the peer has closed."""
        if not self._sock.recv_into(self._buffer, self.PREFIX.size, socket.MSG_WAITALL):
            return None
        section_nbytes, payload_nbytes = self.PREFIX.unpack_from(self._buffer)
        self._sock.recv_into(self._buffer, section_nbytes + payload_nbytes, socket.MSG_WAITALL)
        section = bytes(self._view[:section_nbytes])
        descriptors = self._sections.get(section)
        if descriptors is None:
            descriptors = self._sections[section] = wire._checked_tensor_section(section, 1, self._limit)[0]
        payload = self._buffer[section_nbytes:section_nbytes + payload_nbytes].copy()
        return {d.name: np.ndarray(d.shape, wire.WIRE_DTYPES[d.dtype], buffer=payload, offset=d.offset)
                for d in descriptors}


def phases_us(manifest: Path, iterations: int) -> list[tuple[str, str, float]]:
    """(phase, metric, median us) rows of the ping-pongs of `--phases` (see the docstring)."""
    route = WorkerRoute(name="bench-phases", interpreter=sys.executable, intra_op_num_threads=1)
    tensors = {"x": np.zeros(1024, np.float32)}
    limit = 1 << 20
    rows = []
    nbytes = tensors["x"].nbytes
    for phase, transport, runs_graph in PHASES:
        ours, theirs = socket.socketpair()
        received = np.empty(1024, np.float32)  # the raw transport's fixed receive buffer
        counters = np.frombuffer(mmap.mmap(-1, mmap.PAGESIZE), np.int64, 2)  # posted to the child, to the parent
        mailbox = Mailbox.create(1 << 20)
        pid = os.fork()
        if pid == 0:  # the answering process; its two medians go back through the socket at the end
            ours.close()
            mailbox = Mailbox.attach(mailbox.fd)
            graph = load_session(str(manifest), route)[0] if runs_graph else None
            described = describe(tensors)
            quiet = timings_us(lambda: graph.run(tensors, described), iterations) if graph else np.zeros(1)
            inside, wait, seen = [], wire.SpinWait(theirs, SPIN_WAIT_US), 0
            framing = _MinimalFraming(theirs, limit)
            theirs.send(b"r")
            while True:
                if transport == "codec":
                    wait()
                    try:
                        frame = wire.read_frame(theirs, max_payload_bytes=limit)
                    except wire.PeerClosed:
                        break
                    arrays = wire.read_payload(theirs, frame)
                elif transport == "mailbox":
                    if not (length := mailbox.receive(SPIN_WAIT_US, None, theirs)):  # the parent's last message: done
                        break
                    frame, arrays = wire.read_binary_frame(mailbox.inbox, length, max_payload_bytes=limit,
                                                           copy=False)  # in place, as the worker reads
                elif transport == "minimal":
                    wait()
                    if (arrays := framing.receive()) is None:
                        break
                elif transport == "raw":
                    wait()
                    if not theirs.recv_into(received, nbytes, socket.MSG_WAITALL):
                        break
                    arrays = {"x": received}
                else:
                    seen = _spin_until_changed(counters, 0, seen)
                    if seen < 0:
                        break
                    arrays = tensors
                if graph is not None:
                    start = time.perf_counter_ns()
                    arrays = graph.run(arrays, described)
                    inside.append((time.perf_counter_ns() - start) / 1000.0)
                if transport == "codec":
                    wire.send_frame(theirs, "result", epoch=1, generation=1, tensors=arrays, max_payload_bytes=limit,
                                    binary=True)
                elif transport == "mailbox":
                    mailbox.announce(wire.write_binary_frame(mailbox.outbox, "result", request_id="", stage_id=0, epoch=1,
                                                             generation=1, instance="", tensors=arrays,
                                                             max_payload_bytes=limit))
                elif transport == "minimal":
                    framing.send(arrays)
                elif transport == "raw":
                    theirs.sendall(arrays["y"] if "y" in arrays else arrays["x"])
                else:
                    counters[1] += 1
            theirs.send(np.array([np.median(quiet), np.median(inside) if inside else 0.0]).tobytes())
            os._exit(0)
        theirs.close()
        mailbox.close_fd()
        ours.recv(1)  # loaded and timed alone
        mailbox.unlink()  # the child opened the doorbells
        wait, seen = wire.SpinWait(ours, SPIN_WAIT_US), 0
        framing = _MinimalFraming(ours, limit)

        def round_trip() -> None:
            nonlocal seen
            if transport == "codec":
                wire.send_frame(ours, "run", epoch=1, generation=1, tensors=tensors, max_payload_bytes=limit,
                                binary=True)
                wait()
                wire.recv_message(ours, max_payload_bytes=limit)
            elif transport == "mailbox":
                mailbox.announce(wire.write_binary_frame(mailbox.outbox, "run", request_id="", stage_id=0, epoch=1,
                                                         generation=1, instance="", tensors=tensors,
                                                         max_payload_bytes=limit))
                wire.read_binary_frame(mailbox.inbox, mailbox.receive(SPIN_WAIT_US, None, ours), max_payload_bytes=limit)
            elif transport == "minimal":
                framing.send(tensors)
                wait()
                framing.receive()
            elif transport == "raw":
                ours.sendall(tensors["x"])
                wait()
                ours.recv_into(received, nbytes, socket.MSG_WAITALL)
                received.copy()  # the caller's own array, as recv_message returns one
            else:
                counters[0] += 1
                seen = _spin_until_changed(counters, 1, seen)

        rows.append((phase, "round_trip_median", float(np.median(timings_us(round_trip, iterations)))))
        if transport == "counters":
            counters[0] = -1
        else:
            ours.shutdown(socket.SHUT_WR)
            if transport == "mailbox":
                mailbox.announce(0)
        quiet, inside = np.frombuffer(ours.recv(16), np.float64)
        ours.close()
        os.waitpid(pid, 0)
        if runs_graph:
            rows += [(phase, "graph_run_quiet_median", float(quiet)), (phase, "graph_run_inside_median", float(inside))]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="a tenth of the iterations")
    parser.add_argument("--phases", action="store_true", help="take the 4 KB round trip apart (see the docstring)")
    args = parser.parse_args()
    identity = {
        "cpu": cpu_name(),
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_start": [round(v, 2) for v in os.getloadavg()],
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bundle = identity_bundle(Path(tmp) / "identity")
        if args.phases:
            return _report_phases(phases_us(bundle.manifest_path, 10000), identity, args.json)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(str(bundle.graph_path), options, providers=["CPUExecutionProvider"])
        run_options = ort.RunOptions()
        for case, nbytes, iterations in CASES:
            iterations = max(10, iterations // 10) if args.quick else iterations
            x = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
            feed = {"x": x}
            with contextlib.ExitStack() as workers:
                # the call the worker's GraphSession makes: output names and a held RunOptions (the
                # fastest form of InferenceSession.run, so the worker is not compared with a slower one)
                calls = {"in_process": lambda: session.run(["y"], feed, run_options)}
                for path, mailbox_bytes, spin_us in PATHS:
                    route = WorkerRoute(name="bench-cpu", interpreter=sys.executable, max_io_bytes=128 * 1024 * 1024,
                                        intra_op_num_threads=1, mailbox_bytes=mailbox_bytes(nbytes),
                                        spin_wait_us=spin_us)
                    client = workers.enter_context(WorkerClient.start(route, generation=0))
                    client.load(bundle.manifest_path)
                    assert np.array_equal(client.run(feed, request_id="check", stage_id=0, epoch=0)["y"], x)
                    calls[path] = functools.partial(client.run, feed, request_id="bench", stage_id=0, epoch=0)
                samples = interleaved_timings_us(calls, iterations)
            local = samples.pop("in_process")
            floor = socket_floor_us(nbytes, iterations)
            measured = {
                "in_process_median": np.median(local),
                "in_process_p99": np.percentile(local, 99),
                "socket_echo_floor_median": np.median(floor),
            }
            if nbytes <= 64 * 1024:  # one thread sends and receives: the frame must fit the socket buffer
                measured["codec_encode_cpu"], measured["codec_decode_cpu"] = codec_cpu_us(nbytes, iterations)
            for metric, value in measured.items():
                rows.append({"case": case, "path": "in_process", "metric": metric, "value": round(float(value), 1),
                             "unit": "us", "iterations": iterations, **identity})
            for path, remote in samples.items():
                values = {
                    "worker_median": np.median(remote),
                    "worker_p99": np.percentile(remote, 99),
                    "worker_overhead_median": np.median(remote) - np.median(local),
                }
                for metric, value in values.items():
                    rows.append({"case": case, "path": path, "metric": metric, "value": round(float(value), 1),
                                 "unit": "us", "iterations": iterations, **identity})
    print(f"{'case':<6} {'path':<13} {'metric':<24} {'value':>12}")
    for row in rows:
        print(f"{row['case']:<6} {row['path']:<13} {row['metric']:<24} {row['value']:>10.1f} {row['unit']}")
    default_path = "mailbox" if 4 * 1024 + MAILBOX_HEADROOM <= DEFAULT_MAILBOX_BYTES else "inline"
    overhead = next(r["value"] for r in rows
                    if r["case"] == "4KB" and r["path"] == default_path and r["metric"] == "worker_overhead_median")
    verdict = "meets" if overhead <= TARGET_OVERHEAD_US_4KB else "MISSES"
    print(f"4KB worker overhead {overhead:.1f} us: {verdict} the {TARGET_OVERHEAD_US_4KB:.0f} us target")
    print(f"{identity['cpu']}, python {identity['python']}, onnxruntime {identity['onnxruntime']}, {identity['date']}")
    loadavg_end = [round(v, 2) for v in os.getloadavg()]
    print(f"load average (1, 5, 15 min) at the start {identity['loadavg_start']}, at the end {loadavg_end}")
    for row in rows:
        row["loadavg_end"] = loadavg_end
    if args.json:
        _write_rows(args.json, rows)
    return 0


def _write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=2) + "\n")


def _report_phases(measured: list[tuple[str, str, float]], identity: dict, json_path: Path | None) -> int:
    rows = [{"case": "4KB", "path": phase, "metric": metric, "value": round(value, 1), "unit": "us", **identity}
            for phase, metric, value in measured]
    print(f"{'phase':<44} {'metric':<26} {'value':>10}")
    for row in rows:
        print(f"{row['path']:<44} {row['metric']:<26} {row['value']:>8.1f} {row['unit']}")
    if json_path:
        _write_rows(json_path, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
