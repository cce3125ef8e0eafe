"""A `worker:'<command>'` target: a worker process started from any command, spoken to on its socket.

The command is started the way `WorkerClient.start` starts omnigraph's own worker, so a native
implementation is qualified through the same door: the runner listens on a fresh Unix socket in a
private folder and runs `<command> --connect SOCKET --generation N --route ROUTE_JSON` (the route is
`omnigraph.workers.route.WorkerRoute` as JSON: a CPU route whose `max_io_bytes` is the group's
`max_payload_bytes`). The worker connects, sends `hello` (its body carries `instance`), and then
answers one frame at a time. A worker that drops the stream (as it must after a frame whose length
cannot be trusted) is started again for the next case.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omnigraph.bundles.defaults import DEFAULT_MAX_IO_BYTES
from omnigraph.conformance.frames import BuiltFrame, send_frame_bytes
from omnigraph.conformance.report import CaseFailed
from omnigraph.workers import wire
from omnigraph.workers.route import WorkerRoute

# Why: a worker imports onnxruntime before it connects; a cold start on a busy 2-core machine can
# take several seconds.
START_TIMEOUT_S = 60.0
# Why: every frame of the suite is tiny; a reply later than this means the worker is stuck.
REPLY_TIMEOUT_S = 20.0
# Why: after its socket closes a worker is exiting; give it this long before SIGKILL.
EXIT_GRACE_S = 5.0
# The generation the runner assigns; not 0, so that an "older generation" exists to be refused.
GENERATION = 7
LOG_TAIL_CHARS = 2000


@dataclass(frozen=True)
class Reply:
    """What came back for a frame: one frame (type, body, tensors), or `closed` with no reply."""

    closed: bool
    type: str = ""
    request_id: str = ""
    body: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)


class WorkerStartError(RuntimeError):
    """The target command did not come up as a worker (no connection, no hello, a wrong hello)."""


class WorkerTargetSession:
    """One worker process at a time, restarted when a case leaves it unusable."""

    def __init__(self, command: Sequence[str], *, setup: Mapping[str, Any]) -> None:
        self._command = tuple(command)
        self.max_payload_bytes = int(setup.get("max_payload_bytes", DEFAULT_MAX_IO_BYTES))
        self._route = WorkerRoute(
            name="conformance",
            interpreter=sys.executable,
            ep="cpu",
            min_fraction_on_target=0.0,
            max_io_bytes=self.max_payload_bytes,
            intra_op_num_threads=1,
        )
        self.generation = GENERATION
        self.instance = ""
        self.features: tuple[str, ...] = ()  # what the hello announced
        self.epoch = 0  # the lowest epoch the runner may still use (it only ever grows)
        self.loaded: str | None = None  # which bundle (by the caller's key) the worker holds
        self._process: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._private_dir: Path | None = None

    def __enter__(self) -> WorkerTargetSession:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._private_dir = Path(tempfile.mkdtemp(prefix="omnigraph-conformance-worker-"))
        socket_path = self._private_dir / "worker.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(socket_path))
            listener.listen(1)
            command = [*self._command, "--connect", str(socket_path), "--generation", str(self.generation),
                       "--route", self._route.to_json()]
            with open(self._private_dir / "worker.log", "wb") as log:
                self._process = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            self._sock = self._accept(listener)
            # Every send and receive is bounded: a target that stops reading fails a case, never hangs the run.
            self._sock.settimeout(REPLY_TIMEOUT_S)
        finally:
            listener.close()
        self.loaded = None
        hello = self._receive(START_TIMEOUT_S)
        if hello.closed or hello.type != "hello":
            raise WorkerStartError(f"the worker's first frame is not a hello ({hello}){self._log_tail()}")
        self.features = tuple(hello.body.get("features", ()))
        if hello.body.get("instance") != self.instance or not self.instance:
            raise WorkerStartError(
                f"hello body instance {hello.body.get('instance')!r} disagrees with its header instance "
                f"{self.instance!r}"
            )

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._process is not None:
            try:
                self._process.wait(EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    # ------------------------------------------------------------------------------------------

    def session_fields(self, *, request_id: str, epoch: int | None = None) -> dict[str, Any]:
        """The header fields that make a frame current for this worker."""
        return {"request_id": request_id, "stage_id": 0, "epoch": self.epoch if epoch is None else epoch,
                "generation": self.generation, "instance": self.instance}

    def exchange(self, frame: BuiltFrame, *, timeout: float = REPLY_TIMEOUT_S) -> Reply:
        """Send raw frame bytes (from a thread: a refusing worker may stop reading) and read the reply."""
        assert self._sock is not None
        writer = threading.Thread(target=send_frame_bytes, args=(self._sock, frame), daemon=True)
        writer.start()
        try:
            return self._receive(timeout)
        finally:
            writer.join(timeout)

    def call(self, msg_type: str, *, body: Mapping[str, Any] | None = None, timeout: float = REPLY_TIMEOUT_S) -> Reply:
        """A well-formed control message (load, stats), encoded by omnigraph's own codec, and its reply."""
        self._send_control(msg_type, body=body)
        return self._receive(timeout)

    def fence(self, epoch: int) -> None:
        """Raise the worker's epoch floor (a fence is never answered)."""
        self._send_control("fence", epoch=epoch)

    def _send_control(self, msg_type: str, *, body: Mapping[str, Any] | None = None, epoch: int | None = None) -> None:
        assert self._sock is not None
        fields = self.session_fields(request_id=f"conformance-{msg_type}", epoch=epoch)
        wire.send_frame(self._sock, msg_type, body=body, max_payload_bytes=self.max_payload_bytes, **fields)

    def load_bundle(self, path: Path, *, key: str | None = None) -> tuple[str, str] | None:
        """Ask the worker to load a bundle: None when loaded, else (code, message) of its refusal."""
        reply = self.call("load", body={"manifest_path": str(path)}, timeout=START_TIMEOUT_S)
        if reply.closed:
            raise CaseFailed(f"the worker closed the stream instead of answering a load{self._log_tail()}")
        if reply.type == "loaded":
            self.loaded = key
            return None
        if reply.type == "error":
            return str(reply.body.get("code")), str(reply.body.get("message"))
        raise CaseFailed(f"the worker answered a load with {reply.type!r}")

    def healthy(self) -> bool:
        """True when the worker still answers a stats message (the stream is in sync)."""
        try:
            reply = self.call("stats", timeout=REPLY_TIMEOUT_S)
        except (OSError, wire.WireError, CaseFailed):
            return False
        return not reply.closed and reply.type == "stats_result"

    # ------------------------------------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> socket.socket:
        assert self._process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        listener.settimeout(0.05)
        while True:
            try:
                sock, _ = listener.accept()
                return sock
            except TimeoutError:
                if self._process.poll() is not None:
                    raise WorkerStartError(
                        f"the worker exited with status {self._process.returncode} before connecting{self._log_tail()}"
                    ) from None
                if time.monotonic() > deadline:
                    raise WorkerStartError(
                        f"the worker did not connect within {START_TIMEOUT_S} s{self._log_tail()}") from None

    def _receive(self, timeout: float) -> Reply:
        assert self._sock is not None
        self._sock.settimeout(timeout)
        try:
            frame, arrays = wire.recv_message(self._sock, max_payload_bytes=self.max_payload_bytes)
        except TimeoutError:
            raise CaseFailed(f"no reply within {timeout} s{self._log_tail()}") from None
        except (wire.PeerClosed, wire.TruncatedFrame, ConnectionResetError, BrokenPipeError):
            return Reply(closed=True)
        finally:
            if self._sock is not None:
                self._sock.settimeout(REPLY_TIMEOUT_S)
        if frame.type == "hello":
            self.instance = frame.instance
        return Reply(closed=False, type=frame.type, request_id=frame.request_id, body=frame.body,
                     tensors={name: np.array(value) for name, value in arrays.items()})

    def _log_tail(self) -> str:
        if self._private_dir is None:
            return ""
        try:
            text = (self._private_dir / "worker.log").read_text(errors="replace").strip()
        except OSError:
            return ""
        return f"; worker log ends: {text[-LOG_TAIL_CHARS:]}" if text else ""

