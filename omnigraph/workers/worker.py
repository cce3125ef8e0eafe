"""The graph worker process: ``python -m omnigraph.workers.worker --connect SOCKET --generation N
--route JSON``.

It connects to its controller's Unix socket (or, on another machine, to `tcp:HOST:PORT`, sending
first the one-time token its starter put in OMNIGRAPH_WORKER_TOKEN), announces itself (hello: interpreter, versions,
providers, pid, process start time, a random instance id, wire version and features), then serves
one message at a time: load, run, stats, fence, close. Imports stdlib, numpy, onnxruntime, onnx
and omnigraph.bundles only, plus posix_ipc for the mailbox where the interpreter has it. Given
``--mailbox-fd`` (an inherited descriptor, mailbox.py), it maps the controller's mailbox and says
so in its hello (feature ``mailbox``): from then on run and result frames that fit travel through
shared memory, and every message is announced on a doorbell.

Refusals: a message for another generation or instance, or with an epoch below the highest seen,
gets an error frame (stale_generation / stale_instance / stale_epoch) and changes nothing (a fence
is never answered: it only raises the epoch floor). A
malformed frame gets an error frame with its wire code; when the stream is still in sync (the
prefix was sound) the payload is skipped unread and the worker goes on, otherwise it exits with
EXIT_WIRE_DESYNC. A refused load (bad bundle, placement) leaves the worker usable, with its
previous session (if any) still loaded.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import secrets
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from omnigraph.workers import procfs, wire
from omnigraph.workers.errors import LoadRefused, RemoteError
from omnigraph.workers.mailbox import FEATURE_MAILBOX, Mailbox, MailboxUnavailable, send_message
from omnigraph.workers.process import TCP_PREFIX, WORKER_TOKEN_ENV
from omnigraph.workers.reports import WorkerHello
from omnigraph.workers.route import WorkerRoute
from omnigraph.workers.session import GraphSession, load_session

EXIT_OK = 0
EXIT_WIRE_DESYNC = 3  # a frame broke the wire before its length could be trusted
EXIT_PARENT_GONE = 4  # a remote worker's starter (its node's host actor) exited: it goes with it
# Why: a remote worker whose host actor died (its node lost, the actor killed) must not serve on
# over its open connection; a quarter second is well inside any replacement's start.
PARENT_CHECK_S = 0.25


def _device_memory(device_id: int) -> dict[str, int] | None:
    """cudaMemGetInfo of the route's device, when a CUDA runtime is loadable (else None)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            cudart = ctypes.CDLL(name)
        except OSError:
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if cudart.cudaSetDevice(device_id) != 0 or cudart.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) != 0:
            return None
        return {"device_id": device_id, "free_bytes": free.value, "total_bytes": total.value}
    return None


class GraphWorker:
    """Serves one controller connection."""

    def __init__(self, sock: socket.socket, route: WorkerRoute, generation: int,
                 mailbox: Mailbox | None = None) -> None:
        self._sock = sock
        self._mailbox = mailbox
        self._announcing = False  # after the hello, with a mailbox: every message rings the doorbell
        self._route = route
        self._generation = generation
        self._instance = secrets.token_hex(16)
        self._max_epoch = 0
        self._session: GraphSession | None = None
        self._manifest_sha256: str | None = None
        self._counters = {"runs": 0, "refused_runs": 0, "failed_runs": 0, "loads": 0, "refused_frames": 0}

    def hello(self) -> WorkerHello:
        ticks = procfs.process_start_ticks()
        return WorkerHello(
            interpreter=sys.executable,
            python_version=platform.python_version(),
            onnxruntime_version=ort.__version__,
            onnx_version=onnx.__version__,
            numpy_version=np.__version__,
            available_providers=tuple(ort.get_available_providers()),
            pid=os.getpid(),
            start_time_ticks=ticks,
            start_time_unix=procfs.process_start_unix(ticks),
            instance=self._instance,
            wire_version=wire.WIRE_VERSION,
            features=tuple(sorted(wire.FEATURES | ({FEATURE_MAILBOX} if self._mailbox is not None else set()))),
        )

    def serve(self) -> int:
        """Answer messages until close or the controller goes; returns the exit status."""
        self._send("hello", body=self.hello().to_dict())
        mailbox = self._mailbox
        self._announcing = mailbox is not None
        wait_for_message = wire.SpinWait(self._sock, self._route.spin_wait_us)
        while True:
            try:
                if mailbox is None:
                    wait_for_message()
                else:
                    length = mailbox.receive(self._route.spin_wait_us, None, self._sock)
                    if length:
                        self._serve_mailbox_frame(mailbox, length)
                        continue
                status = self._serve_socket_frame()
            except wire.PeerClosed:
                return EXIT_OK
            if status is not None:
                return status

    def _serve_socket_frame(self) -> int | None:
        """Read and answer one frame from the socket; the exit status once the worker must stop."""
        try:
            frame = wire.read_frame(self._sock, max_payload_bytes=self._route.max_io_bytes)
        except wire.WireError as exc:
            self._counters["refused_frames"] += 1
            self._send_error(None, exc.code, str(exc))
            if exc.pending_payload_bytes is None:
                return EXIT_WIRE_DESYNC
            wire.discard_payload(self._sock, exc.pending_payload_bytes)
            return None
        if frame.type == "fence":  # never answered: raise the floor (a lower fence is moot)
            if frame.generation == self._generation and frame.instance == self._instance:
                self._max_epoch = max(self._max_epoch, frame.epoch)
            wire.discard_payload(self._sock, frame)
            return None
        try:
            self._check_fresh(frame)
        except wire.WireError as exc:
            self._counters["refused_frames"] += 1
            wire.discard_payload(self._sock, frame)
            self._send_error(frame, exc.code, str(exc))
            return None
        arrays = wire.read_payload(self._sock, frame)
        if frame.type == "close":
            self._send("closing", frame)
            return EXIT_OK
        self._dispatch(frame, arrays, via_area=False)
        return None

    def _serve_mailbox_frame(self, mailbox: Mailbox, length: int) -> None:
        """Read and answer the frame in the mailbox (self-contained: a refused one leaves the
        socket's stream as it was). The inputs are read in place: the controller writes the area
        again only after this answer, and nothing keeps them past it."""
        try:
            frame, arrays = wire.read_binary_frame(mailbox.inbox, length, max_payload_bytes=self._route.max_io_bytes,
                                                   copy=False)
        except wire.WireError as exc:
            self._counters["refused_frames"] += 1
            self._send_error(None, exc.code, str(exc))
            return
        try:
            self._check_fresh(frame)
        except wire.WireError as exc:
            self._counters["refused_frames"] += 1
            self._send_error(frame, exc.code, str(exc))
            return
        self._dispatch(frame, arrays, via_area=True)

    def _check_fresh(self, frame: wire.Frame) -> None:
        if frame.generation != self._generation:
            raise wire.StaleGeneration(f"message for generation {frame.generation}, this worker is generation "
                                       f"{self._generation}")
        if frame.instance != self._instance:
            raise wire.StaleInstance(f"message for instance {frame.instance!r}, this worker process is "
                                     f"{self._instance!r}")
        if frame.epoch < self._max_epoch:
            raise wire.StaleEpoch(f"message epoch {frame.epoch} is below the fenced epoch {self._max_epoch}")
        self._max_epoch = frame.epoch

    def _dispatch(self, frame: wire.Frame, arrays: dict[str, np.ndarray], *, via_area: bool) -> None:
        """Answer one message; a result goes back the way its run came (`via_area`: through the
        mailbox's area where it fits), so a controller waiting on the socket is woken by it."""
        try:
            if frame.type == "run":
                self._run(frame, arrays, via_area)
            elif frame.type == "load":
                self._load(frame)
            elif frame.type == "stats":
                self._send("stats_result", frame, body=self._stats())
            else:
                raise RemoteError("unexpected_message", f"a worker does not accept {frame.type!r} messages")
        except LoadRefused as exc:
            report = exc.report.to_dict() if exc.report is not None else None
            self._send_error(frame, exc.code, exc.message, report=report)
        except RemoteError as exc:
            self._send_error(frame, exc.code, exc.message)

    def _run(self, frame: wire.Frame, arrays: dict[str, np.ndarray], via_area: bool) -> None:
        if self._session is None:
            raise RemoteError("not_loaded", "run before a bundle was loaded")
        self._counters["runs"] += 1
        try:
            outputs = self._session.run(arrays, frame.tensors)
        except RemoteError as exc:  # refused inputs, or ORT failed the run
            self._counters["failed_runs" if exc.code == "run_failed" else "refused_runs"] += 1
            raise
        try:
            self._send("result", frame, tensors=outputs, via_area=via_area)
        except wire.WireError as exc:  # refused before anything was sent (e.g. too large): the stream is intact
            self._counters["failed_runs"] += 1
            self._send_error(frame, "outputs_not_sent", f"{exc.code}: {exc}")

    def _load(self, frame: wire.Frame) -> None:
        manifest_path = frame.body.get("manifest_path")
        if not isinstance(manifest_path, str):
            raise RemoteError("malformed_header", "load needs body.manifest_path (a string)")
        self._counters["loads"] += 1
        session, report = load_session(manifest_path, self._route)
        self._session, self._manifest_sha256 = session, report.manifest_sha256
        self._send("loaded", frame, body=report.to_dict())

    def _stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = procfs.memory_status()
        stats.update(self._counters)
        stats["manifest_sha256"] = self._manifest_sha256
        stats["max_epoch"] = self._max_epoch
        stats["cuda_graph_shapes"] = self._session.cuda_graph_shapes if self._session is not None else 0
        stats["device_memory"] = _device_memory(self._route.device_id) if self._route.ep != "cpu" else None
        return stats

    def _send_error(self, frame: wire.Frame | None, code: str, message: str, **extra: Any) -> None:
        self._send("error", frame, body={"code": code, "message": message, **extra})

    def _send(self, msg_type: str, answering: wire.Frame | None = None, *, body: Mapping[str, Any] | None = None,
              tensors: Mapping[str, np.ndarray] | None = None, via_area: bool = True) -> None:
        """Send one message (mailbox.send_message), as the answer to ``answering`` (its request id,
        stage, epoch and kind of header) or on its own: once the hello is out, through the mailbox
        where it fits (and `via_area`), and announced on the controller's doorbell either way."""
        if answering is None:
            request_id, stage_id, epoch, binary = "", 0, 0, False
        else:
            request_id, stage_id, epoch = answering.request_id, answering.stage_id, answering.epoch
            binary = answering.binary
        send_message(
            self._sock, self._mailbox if self._announcing else None, msg_type, request_id=request_id,
            stage_id=stage_id, epoch=epoch, generation=self._generation, instance=self._instance, body=body,
            tensors=tensors, max_payload_bytes=self._route.max_io_bytes, binary=binary, via_area=via_area,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omnigraph.workers.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--connect", required=True, help="the controller's Unix socket path, or tcp:HOST:PORT")
    parser.add_argument("--generation", required=True, type=int, help="the worker generation the controller assigned")
    parser.add_argument("--route", required=True, help="the WorkerRoute as JSON")
    parser.add_argument("--mailbox-fd", type=int,
                        help="an inherited descriptor of the controller's mailbox (mailbox.py)")
    args = parser.parse_args(argv)
    route = WorkerRoute.from_json(args.route)
    mailbox = None
    if args.mailbox_fd is not None:
        try:
            mailbox = Mailbox.attach(args.mailbox_fd)
        except (MailboxUnavailable, OSError, ValueError) as exc:  # the hello then lacks the feature: socket only
            print(f"mailbox not used: {exc}", file=sys.stderr)
    sock = _connect(args.connect)
    try:
        return GraphWorker(sock, route, args.generation, mailbox).serve()
    except (BrokenPipeError, ConnectionResetError, wire.TruncatedFrame):
        return EXIT_OK  # the controller went away: no one is left to answer
    finally:
        sock.close()


def _exit_with_parent(parent: int) -> None:
    """Exit once the process that started this one has (it is then reparented)."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(EXIT_PARENT_GONE)


def _connect(address: str) -> socket.socket:
    """The controller's connection: a Unix socket path, or `tcp:HOST:PORT` (the token first)."""
    if not address.startswith(TCP_PREFIX):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address)
        return sock
    host, _, port = address[len(TCP_PREFIX):].rpartition(":")
    token = os.environ.get(WORKER_TOKEN_ENV, "")
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="omnigraph-parent-watch",
                     daemon=True).start()
    sock = socket.create_connection((host.strip("[]"), int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one small frame per call
    sock.sendall(token.encode("ascii") + b"\n")
    return sock


if __name__ == "__main__":
    sys.exit(main())
