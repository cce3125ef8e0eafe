"""WorkerClient: the controller's handle on one graph worker process (blocking, one call in flight).

``start`` listens on a fresh Unix socket in a private (0700) temporary folder, starts the worker
with the route's interpreter in its own session (terminal signals do not reach it), accepts its
connection (the peer's pid is checked through SO_PEERCRED), removes the socket file at once and
reads the hello. The worker's stdout and stderr go to a log in that folder; its tail is quoted when
the worker dies. ``close`` removes the folder. A worker on another machine (stages/ray_cluster.py)
connects over TCP instead, proves itself with a one-time token (``accept_tcp_worker``), and is
handed to ``attach`` with its WorkerProcess; every call then reads the same.

Calls: ``run`` sends a forward call and waits for its reply; a call that is not answered in time
cannot be pre-empted, so ``run`` then retires the worker (killed, WorkerTimeout). The stage
runtime uses the two halves instead: ``submit`` sends the call, ``result(until)`` takes its reply
or says that none came by ``until`` without consuming anything, so the caller decides how long a
worker may take once its requests are gone (graph_stage.py).

Epochs: ``fence(epoch)`` raises the client's floor at once (a reply for an older epoch is then
discarded with StaleEpoch) and tells the worker, which refuses later messages below it. A worker
that dies mid-call surfaces as WorkerDied with its exit status (socket EOF, then waitpid), never
as a hang.
"""

from __future__ import annotations

import hmac
import os
import select
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

import omnigraph
from omnigraph.bundles.defaults import DEFAULT_STARTUP_TIMEOUT_S
from omnigraph.workers import procfs, wire
from omnigraph.workers.errors import (
    CallRefused,
    LoadRefused,
    PlacementRefused,
    RemoteError,
    WorkerBusy,
    WorkerDied,
    WorkerStartFailed,
    WorkerTimeout,
)
from omnigraph.workers.mailbox import FEATURE_MAILBOX, Mailbox, MailboxUnavailable, send_message
from omnigraph.workers.placement import PlacementReport
from omnigraph.workers.process import WORKER_TOKEN_BYTES, LocalWorkerProcess, WorkerProcess
from omnigraph.workers.reports import LoadReport, WorkerHello
from omnigraph.workers.route import WorkerRoute

WORKER_MODULE = "omnigraph.workers.worker"
WORKER_FOLDER_PREFIX = "omnigraph-worker-"
# Why: after the socket reports EOF the process is exiting; waitpid gets its status within this.
DEATH_REAP_SECONDS = 5.0
# Why: a worker writes each message whole, so once its first bytes are here the rest follows at
# memory speed (64 MiB in well under a second); a frame still incomplete after this is a broken peer.
FRAME_READ_TIMEOUT_S = 10.0
_LOAD_REFUSAL_CODES = frozenset({"bundle_invalid", "load_failed"})
# The folder holding the omnigraph package: put on the worker's PYTHONPATH so an interpreter that
# has only numpy + onnxruntime + onnx installed can import the worker.
_PACKAGE_PARENT = str(Path(omnigraph.__file__).resolve().parent.parent)


class WorkerClient:
    """One graph worker process. Build it with ``WorkerClient.start``."""

    def __init__(
        self,
        *,
        route: WorkerRoute,
        generation: int,
        process: WorkerProcess,
        sock: socket.socket,
        hello: WorkerHello,
        mailbox: Mailbox | None = None,
    ) -> None:
        self.route = route
        self.generation = generation
        self.hello = hello
        # run frames use the binary header, and the mailbox, where the worker reads them (its hello says so)
        self._binary_header = wire.FEATURE_BINARY_HEADER in hello.features
        self._mailbox = mailbox if FEATURE_MAILBOX in hello.features else None
        self._process = process
        self._sock = sock
        self._wait_for_reply = wire.SpinWait(sock, route.spin_wait_us)
        self._readable = select.poll()
        self._readable.register(sock, select.POLLIN)  # hang-ups and errors are always reported too
        self._call_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._min_epoch = 0
        # The highest epoch sent: the worker refuses anything below it, so load / stats / close
        # (which belong to no request) carry it rather than the fenced floor.
        self._sent_epoch = 0
        self._closed = False
        self._sock_timeout: float | None = None
        self._awaiting: str | None = None  # the request id of the forward call in flight
        self.load_report: LoadReport | None = None

    # ------------------------------------------------------------------------------------------
    # Start

    @classmethod
    def start(cls, route: WorkerRoute, *, generation: int,
              startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S) -> WorkerClient:
        """Start a worker for ``route`` and wait (up to ``startup_timeout`` s) for its hello."""
        if type(generation) is not int or generation < 0:
            raise ValueError(f"generation must be an integer >= 0, got {generation!r}")
        if not os.access(route.interpreter, os.X_OK):
            raise WorkerStartFailed(f"route {route.name!r}: interpreter {route.interpreter} is not an executable file")
        deadline = time.monotonic() + startup_timeout
        sweep_stale_worker_folders()
        try:
            private_dir = Path(tempfile.mkdtemp(prefix=f"{WORKER_FOLDER_PREFIX}{os.getpid()}-"))
        except OSError as exc:
            raise WorkerStartFailed(f"route {route.name!r}: cannot create the worker's folder in "
                                    f"{tempfile.gettempdir()} (TMPDIR): {exc.strerror or exc}") from None
        socket_path = private_dir / "worker.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        process: subprocess.Popen | None = None
        handle: LocalWorkerProcess | None = None
        sock: socket.socket | None = None
        mailbox = _new_mailbox(route)
        try:
            listener.bind(str(socket_path))
            listener.listen(1)
            env = {**os.environ, **route.env}
            env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
            command = [
                route.interpreter, "-m", WORKER_MODULE, "--connect", str(socket_path),
                "--generation", str(generation), "--route", route.to_json(),
            ]
            if mailbox is not None:
                command += ["--mailbox-fd", str(mailbox.fd)]
            with open(private_dir / "worker.log", "wb") as log:
                process = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=env, start_new_session=True, close_fds=True,
                    pass_fds=() if mailbox is None or mailbox.fd is None else (mailbox.fd,),
                )
            handle = LocalWorkerProcess(process, private_dir)
            if mailbox is not None:
                mailbox.close_fd()
            sock = _accept_worker(listener, handle, deadline)
            listener.close()
            socket_path.unlink()
            hello = _read_hello(sock, handle, generation, route, deadline)
            if mailbox is not None:
                mailbox.unlink()  # the worker opened the doorbells before its hello, or never will
            return cls(route=route, generation=generation, process=handle, sock=sock, hello=hello, mailbox=mailbox)
        except BaseException:
            if mailbox is not None:
                mailbox.close_fd()
                mailbox.unlink()
            listener.close()
            if sock is not None:
                sock.close()
            if process is not None and process.poll() is None:
                process.kill()
            if process is not None:
                process.wait()
            shutil.rmtree(private_dir, ignore_errors=True)
            raise

    @classmethod
    def attach(cls, route: WorkerRoute, *, generation: int, process: WorkerProcess, sock: socket.socket,
               startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S) -> WorkerClient:
        """The client of a worker started elsewhere (`process`) whose connection `sock` is
        accepted: reads and checks its hello (the socket is closed if it is refused)."""
        try:
            hello = _read_hello(sock, process, generation, route, time.monotonic() + startup_timeout)
        except BaseException:
            sock.close()
            raise
        return cls(route=route, generation=generation, process=process, sock=sock, hello=hello)

    # ------------------------------------------------------------------------------------------
    # Identity and lifetime

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def process(self) -> WorkerProcess:
        """The worker's process (where it runs, its exit)."""
        return self._process

    @property
    def instance(self) -> str:
        return self.hello.instance

    @property
    def min_epoch(self) -> int:
        return self._min_epoch

    @property
    def returncode(self) -> int | None:
        """The exit status once the process was reaped (negative: killed by that signal)."""
        return self._process.poll()

    def kill(self) -> None:
        """SIGKILL the worker (no wait; see wait_exit)."""
        self._process.kill()

    def wait_exit(self, timeout: float) -> bool:
        """True once the OS says the process is gone: reaped by waitpid, and its machine's /proc
        no longer holds a process with its pid and start time."""
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return self._process.gone(self.hello.start_time_ticks)

    def close(self, timeout: float = 10.0) -> int | None:
        """Ask the worker to exit, kill it if it does not within ``timeout``, reap it and remove
        the private folder. Idempotent; returns the exit status."""
        if self._closed:
            return self._process.poll()
        self._closed = True
        if self._process.poll() is None and self._call_lock.acquire(blocking=False):
            try:
                self._send_and_receive("close", expect="closing", timeout=timeout)
                self._process.wait(timeout)
            except (wire.WireError, RemoteError, WorkerDied, WorkerTimeout, OSError, subprocess.TimeoutExpired):
                pass  # kill below
            finally:
                self._call_lock.release()
        if self._process.poll() is None:
            self.kill()
        self._process.wait()
        self._sock.close()
        self._mailbox = None  # unmapped once no call in flight holds it either
        self._process.remove_files()
        return self._process.poll()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------
    # Calls

    def load(self, manifest_path: str | os.PathLike[str], *, timeout: float | None = None) -> LoadReport:
        """Load a bundle (verified again inside the worker), warm it up and check its placement.

        Raises LoadRefused (bundle_invalid, load_failed) or PlacementRefused (``.report``)."""
        with _OneCall(self):
            _, body = self._send_and_receive(
                "load", expect="loaded", body={"manifest_path": os.fspath(manifest_path)}, timeout=timeout
            )
        self.load_report = LoadReport.from_dict(body)
        return self.load_report

    def run(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        request_id: str,
        stage_id: int,
        epoch: int,
        timeout: float | None = None,
    ) -> dict[str, np.ndarray]:
        """One forward call; blocking, one in flight (a second concurrent call: WorkerBusy). No
        reply within ``timeout``: the worker is retired (killed) and WorkerTimeout raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.submit(inputs, request_id=request_id, stage_id=stage_id, epoch=epoch, timeout=timeout)
        outputs = self.result(deadline)
        if outputs is None:
            self._awaiting = None
            self._call_lock.release()
            raise self._retire_silent("run", timeout)
        return outputs

    def submit(self, inputs: Mapping[str, np.ndarray], *, request_id: str, stage_id: int, epoch: int,
               timeout: float | None = None, via_socket: bool = False) -> None:
        """Send one forward call and return; ``result`` takes its reply. The call is in flight (a
        second one: WorkerBusy) until ``result`` returns outputs or raises. CallRefused: refused
        before sending (the worker never saw it). ``timeout`` bounds the send alone. With
        ``via_socket`` the call, and so its reply, travels through the socket even where the mailbox
        would carry it: an event loop can then wait for the reply on ``reply_fd`` and take it with
        ``ready_result``."""
        guard = _OneCall(self)
        guard.__enter__()
        try:
            if epoch < self._min_epoch:
                raise wire.StaleEpoch(f"epoch {epoch} is below the fenced epoch {self._min_epoch}")
            self._set_timeout(None if timeout is None else time.monotonic() + timeout)
            try:
                self._send("run", tensors=inputs, request_id=request_id, stage_id=stage_id, epoch=epoch,
                           binary=self._binary_header, via_area=not via_socket)
            except TimeoutError:  # cut off mid-frame: the stream is lost
                raise self._retire_silent("run", timeout) from None
            except (BrokenPipeError, ConnectionResetError):
                raise self._died("run") from None
        except BaseException:
            self._call_lock.release()
            raise
        self._awaiting = request_id

    @property
    def reply_fd(self) -> int:
        """The descriptor that turns readable when a reply sent through the socket arrives (or the
        worker hangs up): what an event loop watches for a call submitted ``via_socket``."""
        return self._sock.fileno()

    def result(self, until: float | None) -> dict[str, np.ndarray] | None:
        """The reply to the call ``submit`` sent, or None when none came by ``until``
        (time.monotonic; None waits for it): nothing is consumed then, the call is still in flight
        and ``result`` may be asked again. A reply below the fenced epoch raises StaleEpoch: the
        call is over, its outputs discarded, and the worker serves on."""
        return self._take_reply(self._receive, until)

    def ready_result(self) -> dict[str, np.ndarray] | None:
        """``result`` that never waits: the reply if it is here, else None. For an event loop's
        reader on ``reply_fd``: a worker that hung up raises WorkerDied here."""
        return self._take_reply(self._receive_ready, None)

    def _take_reply(self, receive: Callable[[float | None], tuple[wire.Frame, dict[str, np.ndarray]] | None],
                    until: float | None) -> dict[str, np.ndarray] | None:
        request_id = self._awaiting
        if request_id is None:
            raise RuntimeError("no call in flight: submit() one first")
        try:
            received = receive(until)
            if received is None:
                return None
            frame, arrays = received
            self._awaiting = None
            self._check_reply(frame, "result", request_id)
            if frame.epoch < self._min_epoch:
                raise wire.StaleEpoch(f"reply for epoch {frame.epoch} discarded: fenced at {self._min_epoch}")
            return arrays
        except BaseException:
            self._awaiting = None
            raise
        finally:
            if self._awaiting is None:
                self._call_lock.release()

    def fence(self, epoch: int) -> None:
        """Raise the minimum epoch now; replies and calls below it are refused from here on."""
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        if epoch <= self._min_epoch:
            return
        self._min_epoch = epoch
        try:
            self._send("fence", epoch=epoch)
        except OSError:
            raise self._died("fence") from None

    def stats(self, *, timeout: float | None = 10.0) -> dict[str, Any]:
        """RSS, peak RSS, device memory (where available) and call counters of the worker."""
        with _OneCall(self):
            _, body = self._send_and_receive("stats", expect="stats_result", timeout=timeout)
        return body

    # ------------------------------------------------------------------------------------------
    # Plumbing

    def _send(self, msg_type: str, *, request_id: str = "", stage_id: int = 0, epoch: int | None = None,
              body: Mapping[str, Any] | None = None, tensors: Mapping[str, np.ndarray] | None = None,
              binary: bool = False, via_area: bool = True) -> None:
        with self._send_lock:
            if epoch is None:
                epoch = max(self._min_epoch, self._sent_epoch)
            try:
                send_message(
                    self._sock, self._mailbox, msg_type, request_id=request_id, stage_id=stage_id, epoch=epoch,
                    generation=self.generation, instance=self.hello.instance, body=body, tensors=tensors,
                    max_payload_bytes=self.route.max_io_bytes, binary=binary, via_area=via_area,
                )
            except wire.WireError as exc:  # the encoder refuses before sending: the stream is untouched
                raise CallRefused(exc.code, str(exc)) from None
            self._sent_epoch = max(self._sent_epoch, epoch)

    def _send_and_receive(self, msg_type: str, *, expect: str, timeout: float | None,
                          body: Mapping[str, Any] | None = None) -> tuple[wire.Frame, dict[str, Any]]:
        """A control message (load, stats, close) and its reply; no reply within ``timeout``: the
        worker is retired (killed) and WorkerTimeout raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._set_timeout(deadline)  # the send too is bounded by this call's deadline, and only by it
            self._send(msg_type, body=body)
            received = self._receive(deadline)
        except TimeoutError:  # a send cut off mid-frame: the stream is lost
            raise self._retire_silent(msg_type, timeout) from None
        except (BrokenPipeError, ConnectionResetError):
            raise self._died(msg_type) from None
        if received is None:
            raise self._retire_silent(msg_type, timeout)
        frame, _ = received
        self._check_reply(frame, expect, "")
        return frame, frame.body

    def _check_reply(self, frame: wire.Frame, expect: str, request_id: str) -> None:
        """Refuse a reply from another worker, an error reply, or an answer to another message."""
        if frame.generation != self.generation:
            raise wire.StaleGeneration(f"reply from generation {frame.generation}, expected {self.generation}")
        if frame.instance != self.hello.instance:
            raise wire.StaleInstance(f"reply from instance {frame.instance!r}, expected {self.hello.instance!r}")
        if frame.type == "error":
            raise _remote_error(frame.body)
        if frame.type != expect or frame.request_id != request_id:
            raise wire.MalformedHeader(
                f"expected a {expect!r} reply to request {request_id!r}, got {frame.type!r} for {frame.request_id!r}"
            )

    def _receive(self, until: float | None) -> tuple[wire.Frame, dict[str, np.ndarray]] | None:
        """The worker's next message: from the mailbox when its doorbell says so, else from the
        socket; None when nothing arrived by ``until`` (nothing is consumed then). A message once
        begun must arrive whole within FRAME_READ_TIMEOUT_S, or the worker is retired."""
        mailbox = self._mailbox
        if mailbox is None:
            self._wait_for_reply()
            if not self._readable.poll(_poll_ms(until)):
                return None
            return self._read_socket_message()
        try:
            length = mailbox.receive(self.route.spin_wait_us, until, self._sock)
        except wire.PeerClosed:
            raise self._died("a call") from None
        if length is None:
            return None
        return self._read_area_message(length) if length else self._read_socket_message()

    def _receive_ready(self, _until: float | None) -> tuple[wire.Frame, dict[str, np.ndarray]] | None:
        """``_receive`` without waiting: the message if it is posted (or on the socket) now."""
        mailbox = self._mailbox
        if mailbox is not None:
            length = mailbox.take_post()
            if length:
                return self._read_area_message(length)
            if length is None and not self._readable.poll(0):
                return None
            # posted on the socket, or readable with nothing posted: the worker hung up (EOF)
        elif not self._readable.poll(0):
            return None
        return self._read_socket_message()

    def _read_area_message(self, length: int) -> tuple[wire.Frame, dict[str, np.ndarray]]:
        assert self._mailbox is not None
        return wire.read_binary_frame(self._mailbox.inbox, length, max_payload_bytes=self.route.max_io_bytes)

    def _read_socket_message(self) -> tuple[wire.Frame, dict[str, np.ndarray]]:
        try:
            self._set_timeout(time.monotonic() + FRAME_READ_TIMEOUT_S)
            frame = wire.read_frame(self._sock, max_payload_bytes=self.route.max_io_bytes)
            return frame, wire.read_payload(self._sock, frame)
        except TimeoutError:
            raise self._retire_silent("a message", FRAME_READ_TIMEOUT_S) from None
        except (wire.PeerClosed, wire.TruncatedFrame, BrokenPipeError, ConnectionResetError):
            raise self._died("a call") from None

    def _retire_silent(self, during: str, timeout: float | None) -> WorkerTimeout:
        """The worker did not answer in time: kill it (a call cannot be pre-empted) and say so."""
        self.kill()
        self.wait_exit(DEATH_REAP_SECONDS)
        return WorkerTimeout(f"worker {self.pid}: {during!r} not answered within {timeout} s; "
                             "the worker was retired (killed)")

    def _set_timeout(self, deadline: float | None) -> None:
        """The socket's timeout for the rest of a call (only a change costs a system call)."""
        timeout = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
        if timeout != self._sock_timeout:
            self._sock.settimeout(timeout)
            self._sock_timeout = timeout

    def _died(self, during: str) -> WorkerDied:
        try:
            status = self._process.wait(DEATH_REAP_SECONDS)
        except subprocess.TimeoutExpired:  # the socket closed but the process lingers: retire it
            self.kill()
            status = self._process.wait()
        return WorkerDied(
            f"worker {self.pid} (generation {self.generation}) died during {during!r} with status {status}"
            f"{self._process.log_tail()}",
            exit_status=status,
        )


class _OneCall:
    """The guard every call runs under: one in flight (a second: WorkerBusy), none once closed. A
    plain class rather than a generator, since every call enters one (made per call, so the client
    holds no reference back to itself)."""

    __slots__ = ("_client",)

    def __init__(self, client: WorkerClient) -> None:
        self._client = client

    def __enter__(self) -> None:
        client = self._client
        if not client._call_lock.acquire(blocking=False):
            raise WorkerBusy(f"worker {client.pid} (generation {client.generation}) already has a call in flight")
        if client._closed:
            client._call_lock.release()
            raise WorkerDied(f"worker {client.pid} was closed", exit_status=client._process.poll())

    def __exit__(self, *exc_info: object) -> None:
        self._client._call_lock.release()


def sweep_stale_worker_folders() -> list[Path]:
    """Remove the worker folders in TMPDIR whose controller process is gone (a server killed with
    SIGKILL cannot remove its own); returns what was removed. A folder is named
    `omnigraph-worker-<controller pid>-<random>`; one whose controller still runs is kept."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{WORKER_FOLDER_PREFIX}*-*"):
        owner = folder.name[len(WORKER_FOLDER_PREFIX):].split("-", 1)[0]
        if not owner.isdigit() or int(owner) == os.getpid() or procfs.process_alive(int(owner)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _poll_ms(until: float | None) -> int | None:
    """select.poll's timeout until ``until`` (time.monotonic): None waits for ever, 0 does not wait."""
    return None if until is None else max(0, int((until - time.monotonic()) * 1000) + 1)


def _new_mailbox(route: WorkerRoute) -> Mailbox | None:
    """The mailbox a worker of ``route`` will share, or None (the route asks for none, or this
    host cannot share one: every frame then goes through the socket)."""
    if not route.mailbox_bytes:
        return None
    try:
        return Mailbox.create(route.mailbox_bytes)
    except MailboxUnavailable:
        return None


def _remote_error(body: Mapping[str, Any]) -> Exception:
    code = str(body.get("code", "unknown"))
    message = str(body.get("message", ""))
    if code in wire.WIRE_ERRORS:
        return wire.WIRE_ERRORS[code](f"the worker refused the frame: {message}")
    if code == "placement_refused":
        return PlacementRefused(code, message, PlacementReport.from_dict(body["report"]))
    if code in _LOAD_REFUSAL_CODES:
        report = body.get("report")
        return LoadRefused(code, message, PlacementReport.from_dict(report) if report else None)
    return RemoteError(code, message)


def _accept_one(listener: socket.socket, process: WorkerProcess, deadline: float) -> socket.socket:
    """The next connection on `listener`, refusing once `process` exited or `deadline` passed."""
    listener.settimeout(0.05)
    while True:
        try:
            sock, _ = listener.accept()
            sock.settimeout(None)
            return sock
        except TimeoutError:
            status = process.poll()
            if status is not None:
                raise WorkerStartFailed(
                    f"worker exited with status {status} before connecting{process.log_tail()}") from None
            if time.monotonic() > deadline:
                raise WorkerStartFailed(f"worker {process.pid} did not connect in time{process.log_tail()}") from None


def _accept_worker(listener: socket.socket, process: WorkerProcess, deadline: float) -> socket.socket:
    """Accept the worker's connection, checking the peer is the process we started."""
    sock = _accept_one(listener, process, deadline)
    pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if pid != process.pid:
        sock.close()
        raise WorkerStartFailed(f"a process {pid} other than the worker {process.pid} connected")
    return sock


def new_worker_token() -> str:
    """A one-time token for a remote worker (given it in process.WORKER_TOKEN_ENV)."""
    return os.urandom(WORKER_TOKEN_BYTES).hex()


def accept_tcp_worker(listener: socket.socket, token: str, process: WorkerProcess, deadline: float) -> socket.socket:
    """Accept a remote worker's TCP connection: its first line must be `token` (compared in
    constant time); any other peer is closed and waited past, until `deadline`."""
    while True:
        sock = _accept_one(listener, process, deadline)
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
        try:
            given = _read_token_line(sock)
        except OSError:
            given = b""
        if hmac.compare_digest(given, token.encode("ascii")):
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one small frame per call
            return sock
        sock.close()


def _read_token_line(sock: socket.socket) -> bytes:
    wanted = 2 * WORKER_TOKEN_BYTES + 1
    received = b""
    while len(received) < wanted:
        chunk = sock.recv(wanted - len(received))
        if not chunk:
            break
        received += chunk
    return received[:-1] if received.endswith(b"\n") else b""


def _read_hello(sock: socket.socket, process: WorkerProcess, generation: int, route: WorkerRoute,
                deadline: float) -> WorkerHello:
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    try:
        frame, _ = wire.recv_message(sock, max_payload_bytes=route.max_io_bytes)
    except TimeoutError:
        raise WorkerStartFailed(f"worker {process.pid} sent no hello in time{process.log_tail()}") from None
    except (wire.PeerClosed, wire.TruncatedFrame, ConnectionResetError):
        try:
            status: int | None = process.wait(DEATH_REAP_SECONDS)
        except subprocess.TimeoutExpired:
            status = None
        raise WorkerStartFailed(f"worker exited with status {status} before its hello{process.log_tail()}") from None
    finally:
        sock.settimeout(None)
    if frame.type != "hello":
        raise WorkerStartFailed(f"worker's first message is {frame.type!r}, not hello: {frame.body}")
    try:
        hello = WorkerHello.from_dict(frame.body)
    except (KeyError, TypeError) as exc:
        raise WorkerStartFailed(f"worker's hello lacks {exc}") from None
    if hello.pid != process.pid or frame.generation != generation or frame.instance != hello.instance:
        raise WorkerStartFailed(
            f"hello from pid {hello.pid} generation {frame.generation} does not match worker {process.pid} "
            f"generation {generation}"
        )
    if hello.wire_version != wire.WIRE_VERSION:
        raise WorkerStartFailed(f"worker speaks wire version {hello.wire_version}, this controller {wire.WIRE_VERSION}")
    return hello
