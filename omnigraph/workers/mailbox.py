"""The mailbox: a shared-memory path beside the socket for the wire's binary ``run`` / ``result``
frames, with one doorbell per side (stdlib + numpy, and posix_ipc for the doorbells).

Why: on the 2-core CI virtual machine a socket round trip costs 25-35 us in the kernel between two
polling processes, and a sleeping thread takes 100-300 us to wake; a POSIX semaphore posted and
taken without sleeping costs under 1 us and no system call (``benchmarks/wire.py``, which also
says where this pays: the results in benchmarks/results/wire-*.md). The frames themselves are
unchanged: a frame that fits is written here byte for byte as it would go through the socket, and
read back with the socket path's checks (wire.write_binary_frame / wire.read_binary_frame). A
controller may send a run through the socket instead (an event loop waiting for the reply can wait
on a socket, not on a semaphore); the worker answers a run the way it came.

The region is an anonymous memory file (``memfd_create``) the controller creates before it starts
the worker, which inherits the descriptor (``--mailbox-fd``) and maps it shared, as three mappings
(the control block and each area on its own, so an area is an ``mmap`` that takes an array's
memory in one slice assignment)::

    [0, 16)         i64 number, i64 length: the frame in the request area, and which of the
                    controller's posts announced it (posts are numbered from 1)
    [16, 32)        the same for the reply area
    [32, 48)        magic b"OGMB", u32 MAILBOX_VERSION, u64 area bytes
    [48, 112)       the doorbells' name stem (UTF-8, NUL padded): the worker's doorbell is
                    stem + "-w", the controller's stem + "-c"
    [page, +area)   the request area (controller -> worker)
    [page + span, +area)  the reply area (worker -> controller); span is the area bytes rounded
                    up to whole pages, since a mapping starts on a page

The doorbells are named POSIX semaphores (posix_ipc). The controller creates them, the worker
opens them by the stem it reads here, and the controller unlinks both names once the worker's
hello is in (``unlink``), so nothing stays in /dev/shm; names whose controller died before that
are swept at the next ``create`` (the stem carries the controller's pid).

Every message after the hello is announced by one post on the receiver's doorbell, whichever way
it travels: the sender writes the frame into its area, its length and the number of the post to
come, or sends the message through the socket, then posts. Each side counts the posts it makes
and takes; the receiver takes one post per message, and the message is in the area exactly when
the area's number is that of the post just taken, else on the socket (a later frame's number is
higher, so a frame written while an earlier post is taken is never mistaken for it; sem_post and
sem_trywait order the memory around them). So the doorbell is the only thing a side waits on: it
polls it (``spin_us``), then sleeps on it in slices of PEER_CHECK_S, checking between slices
whether the peer's socket hung up (a dead peer never posts). The areas need no lock: the
controller has one call in flight, so each area has one writer at a time, and the reader is done
with a frame (copied out, or used in place) before it answers. Fences travel through the socket
and are posted like any message; they are never answered.

The worker room imports nothing beyond numpy and onnxruntime by rule, so posix_ipc is imported
only here, when a mailbox is made: an interpreter without it gets MailboxUnavailable, and its
worker serves through the socket alone.
"""

from __future__ import annotations

import glob
import mmap
import os
import secrets
import select
import socket
import struct
import time
import weakref
from collections.abc import Mapping
from typing import Any

from omnigraph.workers import procfs, wire

FEATURE_MAILBOX = "mailbox"  # announced in the worker's hello once it mapped the mailbox
MAILBOX_VERSION = 3  # 3: named semaphores (posix_ipc) instead of sem_t inside the region
MAGIC = b"OGMB"
# Why: room for a 4 KB call and the ids, headers and paddings around it, and far below any RAM
# budget (a worker maps two areas).
MIN_AREA_BYTES = 4096
# Why: both processes map both areas; frames this large gain nothing from shared memory
# (benchmarks/results/wire-*.md: at 64 MB the socket is level or faster).
MAX_AREA_BYTES = 1 << 30
# Why: a peer that died never posts; a sleeping side looks at its socket this often.
PEER_CHECK_S = 0.05
# Why: a polling side hands its CPU to any other runnable thread this often; on a loaded 2-core
# machine a side that held the CPU longer starved its own peer.
SPIN_YIELD_S = 5e-6
# Why: semaphore names are NAME_MAX-bounded identifiers; the stem plus "-w" must fit its field.
NAME_STEM_BYTES = 64
NAME_PREFIX = "/omnigraph-mailbox-"
_CONTROL_BYTES = mmap.ALLOCATIONGRANULARITY  # one page: the areas start on a page of their own
_SLOT = struct.Struct("<qq")  # (post number, frame length) of one area
_SLOT_OFFSETS = (0, 16)  # the request area's slot, the reply area's
_HEADER = struct.Struct(f"<4sIQ{NAME_STEM_BYTES}s")
_HEADER_OFFSET = 32
_SEM_SHM_DIR = "/dev/shm"  # where Linux keeps a named semaphore "/x" as "sem.x"


class MailboxUnavailable(OSError):
    """This host or interpreter cannot share a mailbox (no memfd, or no posix_ipc)."""


def _posix_ipc() -> Any:
    try:
        import posix_ipc
    except ImportError as exc:
        raise MailboxUnavailable(f"no posix_ipc in this interpreter: {exc}") from None
    return posix_ipc


def _area_span(area_bytes: int) -> int:
    """The bytes an area takes in the file: whole pages, so that the next one starts on a page."""
    return -(-area_bytes // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY


def sweep_stale_doorbells() -> list[str]:
    """Unlink the doorbell names of controllers that died before their worker's hello (a name is
    ``NAME_PREFIX<controller pid>-<random>-w|c``); returns the names removed."""
    removed = []
    for path in glob.glob(os.path.join(_SEM_SHM_DIR, "sem." + NAME_PREFIX[1:] + "*")):
        name = "/" + os.path.basename(path)[len("sem."):]
        owner = name[len(NAME_PREFIX):].split("-", 1)[0]
        if not owner.isdigit() or int(owner) == os.getpid() or procfs.process_alive(int(owner)):
            continue
        try:
            _posix_ipc().unlink_semaphore(name)
            removed.append(name)
        except (OSError, Exception):  # posix_ipc.ExistentialError: another sweeper got it first
            pass
    return removed


class Mailbox:
    """One side's view of the shared region: it writes its outbox and rings the peer's doorbell,
    and waits on its own doorbell and reads its inbox. Build it with ``create`` (the controller)
    or ``attach`` (the worker).

    The mappings and semaphores are released when the Mailbox is garbage collected, never
    explicitly: a thread may still be waiting on a doorbell, so they live as long as it is referenced.
    """

    def __init__(self, fd: int, area_bytes: int, stem: str, *, controller: bool, create: bool) -> None:
        ipc = _posix_ipc()
        self._no_post = (ipc.BusyError, ipc.SignalError)  # a slice ended, or a signal cut it short
        flags = ipc.O_CREX if create else 0
        to_worker = ipc.Semaphore(stem + "-w", flags, mode=0o600, initial_value=0)
        try:
            to_controller = ipc.Semaphore(stem + "-c", flags, mode=0o600, initial_value=0)
        except BaseException:
            to_worker.close()
            raise
        self._names = [stem + "-w", stem + "-c"] if create else []
        weakref.finalize(self, _release, to_worker, to_controller, self._names)
        span = _area_span(area_bytes)
        self._control = mmap.mmap(fd, _CONTROL_BYTES, mmap.MAP_SHARED)
        requests = mmap.mmap(fd, area_bytes, mmap.MAP_SHARED, offset=_CONTROL_BYTES)
        replies = mmap.mmap(fd, area_bytes, mmap.MAP_SHARED, offset=_CONTROL_BYTES + span)
        if controller:
            self.outbox, self.inbox, self._bell, self._peer_bell = requests, replies, to_controller, to_worker
            self._out_slot, self._in_slot = _SLOT_OFFSETS
        else:
            self.outbox, self.inbox, self._bell, self._peer_bell = replies, requests, to_worker, to_controller
            self._in_slot, self._out_slot = _SLOT_OFFSETS
        self._posted = 0  # posts made on the peer's doorbell
        self._taken = 0   # posts taken from this side's doorbell
        self.fd: int | None = None

    @classmethod
    def create(cls, area_bytes: int) -> Mailbox:
        """The controller's side: a fresh region and two fresh doorbells at 0. ``fd`` is the
        descriptor to hand to the worker (``close_fd`` once it has started); ``unlink`` once the
        worker has opened the doorbells (its hello)."""
        if type(area_bytes) is not int or not MIN_AREA_BYTES <= area_bytes <= MAX_AREA_BYTES:
            raise ValueError(f"mailbox area must be an integer in [{MIN_AREA_BYTES}, {MAX_AREA_BYTES}] bytes")
        _posix_ipc()
        sweep_stale_doorbells()
        try:
            fd = os.memfd_create("omnigraph-mailbox", os.MFD_CLOEXEC)
        except (AttributeError, OSError) as exc:
            raise MailboxUnavailable(f"no memory files here: {exc}") from None
        stem = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        try:
            os.ftruncate(fd, _CONTROL_BYTES + 2 * _area_span(area_bytes))
            mailbox = cls(fd, area_bytes, stem, controller=True, create=True)
            _HEADER.pack_into(mailbox._control, _HEADER_OFFSET, MAGIC, MAILBOX_VERSION, area_bytes, stem.encode())
        except BaseException:
            os.close(fd)
            _unlink([stem + "-w", stem + "-c"])
            raise
        mailbox.fd = fd
        return mailbox

    @classmethod
    def attach(cls, fd: int) -> Mailbox:
        """The worker's side: map the region the controller created and open its doorbells
        (closing the descriptor)."""
        try:
            size = os.fstat(fd).st_size
            if size < _CONTROL_BYTES:
                raise MailboxUnavailable(f"mailbox file holds {size} bytes, less than its control block")
            with mmap.mmap(fd, _CONTROL_BYTES, mmap.MAP_SHARED) as control:
                magic, version, area_bytes, stem_bytes = _HEADER.unpack_from(control, _HEADER_OFFSET)
            stem = stem_bytes.rstrip(b"\0").decode("utf-8", "replace")
            if magic != MAGIC or version != MAILBOX_VERSION or not MIN_AREA_BYTES <= area_bytes <= MAX_AREA_BYTES \
                    or size != _CONTROL_BYTES + 2 * _area_span(area_bytes) or not stem.startswith(NAME_PREFIX):
                raise MailboxUnavailable(f"not an omnigraph mailbox of version {MAILBOX_VERSION}: "
                                         f"{magic!r} version {version}, {size} bytes for areas of {area_bytes}")
            try:
                return cls(fd, area_bytes, stem, controller=False, create=False)
            except _posix_ipc().ExistentialError as exc:
                raise MailboxUnavailable(f"the mailbox's doorbells {stem}-w/-c are gone: {exc}") from None
        finally:
            os.close(fd)

    def close_fd(self) -> None:
        """Close the controller's copy of the descriptor (the worker holds its own mapping)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def unlink(self) -> None:
        """Remove the doorbells' names (the controller's side, once the worker opened them or will
        not); the semaphores live on for whoever has them open. Idempotent."""
        _unlink(self._names)

    def announce(self, frame_bytes: int) -> None:
        """Ring the peer's doorbell for one message: the frame just written to the outbox
        (``frame_bytes`` long) or, with 0, one sent through the socket. The caller serialises its
        sends (one announcement per message, in order)."""
        self._posted += 1
        if frame_bytes:
            _SLOT.pack_into(self._control, self._out_slot, self._posted, frame_bytes)
        self._peer_bell.release()

    def receive(self, spin_us: int, deadline: float | None, peer: socket.socket) -> int | None:
        """Take one post of this side's doorbell and say where its message is: the length of the
        frame in the inbox, or 0 when the message is on the socket; None once ``deadline``
        (time.monotonic) has passed with no post. Polls for up to ``spin_us`` first (yielding the
        CPU every SPIN_YIELD_S), then sleeps. Raises PeerClosed when the peer's socket hangs up with
        nothing posted."""
        bell = self._bell
        if not bell.value:  # sem_getvalue: a read of the shared counter, no system call
            now = time.perf_counter()
            end, next_yield = now + spin_us / 1e6, now + SPIN_YIELD_S
            while not bell.value:
                now = time.perf_counter()
                if now >= end:
                    if not self._sleep_for_post(deadline, peer):
                        return None
                    break
                if now >= next_yield:
                    os.sched_yield()
                    next_yield = now + SPIN_YIELD_S
            else:
                bell.acquire(0)  # this side is the only one that takes: the post is there
        else:
            bell.acquire(0)
        return self._where_taken()

    def take_post(self) -> int | None:
        """`receive` without waiting: where the posted message is (the inbox frame's length, or 0
        for the socket), or None when nothing is posted. What an event loop's reader calls once the
        socket is readable: a message sent through the socket is posted before it is sent."""
        if not self._bell.value:
            return None
        self._bell.acquire(0)
        return self._where_taken()

    def _where_taken(self) -> int:
        self._taken += 1
        number, length = _SLOT.unpack_from(self._control, self._in_slot)
        return length if number == self._taken else 0

    def _sleep_for_post(self, deadline: float | None, peer: socket.socket) -> bool:
        """Sleep on this side's doorbell until a post is taken (True) or ``deadline`` (False),
        looking for a hung-up peer between slices of PEER_CHECK_S. posix_ipc times a slice by the
        wall clock (sem_timedwait); the deadline is kept by the monotonic clock between slices."""
        bell, no_post = self._bell, self._no_post
        hang_up = select.poll()
        hang_up.register(peer, 0)  # hang-ups and errors only
        while True:
            pause = PEER_CHECK_S if deadline is None else min(PEER_CHECK_S, deadline - time.monotonic())
            try:
                bell.acquire(max(pause, 0))  # 0: a try, no sleep
                return True
            except no_post:
                pass
            if pause <= 0:
                return False
            if hang_up.poll(0):
                try:
                    bell.acquire(0)  # the peer posted, then went
                    return True
                except no_post:
                    raise wire.PeerClosed("the peer hung up") from None


def _unlink(names: list[str]) -> None:
    """Unlink these semaphore names and empty the list (a name already gone is skipped)."""
    while names:
        try:
            _posix_ipc().unlink_semaphore(names.pop())
        except Exception:  # posix_ipc.ExistentialError: already gone
            pass


def _release(to_worker: Any, to_controller: Any, names: list[str]) -> None:
    """A collected Mailbox's semaphores: names not yet unlinked go, and both are closed."""
    _unlink(names)
    for semaphore in (to_worker, to_controller):
        try:
            semaphore.close()
        except Exception:  # already closed
            pass


def send_message(sock: socket.socket, mailbox: Mailbox | None, msg_type: str, *, request_id: str, stage_id: int,
                 epoch: int, generation: int, instance: str, body: Mapping[str, Any] | None,
                 tensors: Mapping[str, Any] | None, max_payload_bytes: int, binary: bool,
                 via_area: bool = True) -> None:
    """Send one message the way the peer reads it: a binary run or result that fits the mailbox
    through the mailbox (unless `via_area` is False), anything else through the socket
    (wire.encode_frame); with a mailbox, announced either way, before the socket send so that the
    peer reads while a large frame goes out, and so that a socket reply's post is there once the
    socket is readable (Mailbox.take_post). Refuses (a WireError, before anything is written or
    sent) what the receiver would refuse. The caller serialises its sends."""
    if via_area and mailbox is not None and binary and not body and msg_type in wire.BINARY_MESSAGE_TYPES:
        length = wire.write_binary_frame(
            mailbox.outbox, msg_type, request_id=request_id, stage_id=stage_id, epoch=epoch, generation=generation,
            instance=instance, tensors=tensors or {}, max_payload_bytes=max_payload_bytes,
        )
        if length is not None:
            mailbox.announce(length)
            return
    frame = wire.encode_frame(
        msg_type, request_id=request_id, stage_id=stage_id, epoch=epoch, generation=generation, instance=instance,
        body=body, tensors=tensors, max_payload_bytes=max_payload_bytes, binary=binary,
    )
    if mailbox is not None:
        mailbox.announce(0)
    frame.send(sock)
