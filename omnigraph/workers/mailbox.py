"""The mailbox: a shared-memory path beside the socket for the wire's binary ``run`` / ``result``
frames, with one doorbell per side (stdlib + numpy only; the semaphores through ctypes and libc).

Why: on the 2-core CI virtual machine a socket round trip of 4 KB costs 25-35 us in the kernel
between two polling processes, and a sleeping thread takes 100-300 us to wake; a process-shared
semaphore posted and taken without sleeping costs about 1 us a round trip
(``benchmarks/wire.py --phases``). The frames themselves are unchanged: a frame that fits the
mailbox is written there byte for byte as it would go through the socket, and read back with the
socket path's checks (wire.write_binary_frame / wire.read_binary_frame).

The region is an anonymous memory file (``memfd_create``) the controller creates before it starts
the worker, which inherits the descriptor (``--mailbox-fd``) and maps it shared, as three mappings
(the control block and each area on its own, so an area is an ``mmap`` that takes an array's
memory in one slice assignment)::

    [0, 64)         semaphore: messages for the worker (its doorbell)
    [64, 128)       semaphore: messages for the controller
    [128, 144)      i64 number, i64 length: the frame in the request area, and which of the
                    controller's posts announced it (posts are numbered from 1)
    [144, 160)      the same for the reply area
    [160, 176)      magic b"OGMB", u32 MAILBOX_VERSION, u64 area bytes
    [page, +area)   the request area (controller -> worker); page is 4096 bytes on x86-64
    [page + span, +area)  the reply area (worker -> controller); span is the area bytes rounded
                    up to whole pages, since a mapping starts on a page

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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import mmap
import os
import select
import socket
import struct
import time
from typing import Any, Mapping

import numpy as np

from omnigraph.workers import wire

FEATURE_MAILBOX = "mailbox"  # announced in the worker's hello once it mapped the mailbox
MAILBOX_VERSION = 2  # 2: each area starts on a page of its own
MAGIC = b"OGMB"
# Why: room for a 4 KB call and the ids, headers and paddings around it, and far below any RAM
# budget (a worker maps two areas).
MIN_AREA_BYTES = 4096
# Why: both processes map both areas; tensors this large belong in their own memory files.
MAX_AREA_BYTES = 1 << 30
# Why: a peer that died never posts; a sleeping side looks at its socket this often.
PEER_CHECK_S = 0.05
# Why: a polling side gives its CPU to any other runnable thread this often. Yielding at every poll
# slowed the code after each wait by 5-8 us a round trip on the CI machine (a system call per poll).
SPIN_YIELD_S = 50e-6
_CONTROL_BYTES = mmap.ALLOCATIONGRANULARITY  # one page: the areas start on a page of their own
_SEM_T_BYTES = 64  # glibc's sem_t is 32 bytes on 64-bit hosts; each gets its own cache line
_SEM_OFFSETS = (0, _SEM_T_BYTES)  # the worker's doorbell, the controller's
_SLOT = struct.Struct("<qq")  # (post number, frame length) of one area
_SLOT_OFFSETS = (128, 144)  # the request area's slot, the reply area's
_HEADER = struct.Struct("<4sIQ")
_HEADER_OFFSET = 160


def _area_span(area_bytes: int) -> int:
    """The bytes an area takes in the file: whole pages, so that the next one starts on a page."""
    return -(-area_bytes // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY


class MailboxUnavailable(OSError):
    """This host cannot share a mailbox (no memfd or no process-shared semaphores)."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc's semaphore functions, typed. sem_clockwait (glibc 2.30) sleeps against the monotonic
    clock; where it is missing, sem_timedwait sleeps against the wall clock."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    for name in ("sem_init", "sem_post", "sem_trywait", "sem_timedwait"):
        getattr(libc, name).restype = ctypes.c_int
    libc.sem_init.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint)
    libc.sem_post.argtypes = libc.sem_trywait.argtypes = (ctypes.c_void_p,)
    libc.sem_timedwait.argtypes = (ctypes.c_void_p, ctypes.POINTER(_Timespec))
    if hasattr(libc, "sem_clockwait"):
        libc.sem_clockwait.restype = ctypes.c_int
        libc.sem_clockwait.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Timespec))
    return libc


class Mailbox:
    """One side's view of the shared region: it writes its outbox and rings the peer's doorbell,
    and waits on its own doorbell and reads its inbox. Build it with ``create`` (the controller)
    or ``attach`` (the worker).

    The mappings are never unmapped explicitly: a thread may still be waiting on a doorbell inside
    one, so they live as long as the Mailbox is referenced.
    """

    def __init__(self, fd: int, area_bytes: int, *, controller: bool) -> None:
        try:
            self._libc = _libc()
        except (OSError, AttributeError) as exc:  # no libc, or one without POSIX semaphores
            raise MailboxUnavailable(f"no process-shared semaphores here: {exc}") from None
        span = _area_span(area_bytes)
        self._control = mmap.mmap(fd, _CONTROL_BYTES, mmap.MAP_SHARED)
        requests = mmap.mmap(fd, area_bytes, mmap.MAP_SHARED, offset=_CONTROL_BYTES)
        replies = mmap.mmap(fd, area_bytes, mmap.MAP_SHARED, offset=_CONTROL_BYTES + span)
        base = np.frombuffer(self._control, np.uint8).ctypes.data
        to_worker, to_controller = (ctypes.c_void_p(base + offset) for offset in _SEM_OFFSETS)
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
        """The controller's side: a fresh region with both doorbells at 0. ``fd`` is the
        descriptor to hand to the worker (``close_fd`` once it has started)."""
        if type(area_bytes) is not int or not MIN_AREA_BYTES <= area_bytes <= MAX_AREA_BYTES:
            raise ValueError(f"mailbox area must be an integer in [{MIN_AREA_BYTES}, {MAX_AREA_BYTES}] bytes")
        try:
            fd = os.memfd_create("omnigraph-mailbox", os.MFD_CLOEXEC)
        except (AttributeError, OSError) as exc:
            raise MailboxUnavailable(f"no memory files here: {exc}") from None
        try:
            os.ftruncate(fd, _CONTROL_BYTES + 2 * _area_span(area_bytes))
            mailbox = cls(fd, area_bytes, controller=True)
            for bell in (mailbox._bell, mailbox._peer_bell):
                if mailbox._libc.sem_init(bell, 1, 0):  # process-shared, no post yet
                    raise MailboxUnavailable(f"sem_init failed: {os.strerror(ctypes.get_errno())}")
            _HEADER.pack_into(mailbox._control, _HEADER_OFFSET, MAGIC, MAILBOX_VERSION, area_bytes)
        except BaseException:
            os.close(fd)
            raise
        mailbox.fd = fd
        return mailbox

    @classmethod
    def attach(cls, fd: int) -> Mailbox:
        """The worker's side: map the region the controller created (closing the descriptor)."""
        try:
            size = os.fstat(fd).st_size
            if size < _CONTROL_BYTES:
                raise MailboxUnavailable(f"mailbox file holds {size} bytes, less than its control block")
            with mmap.mmap(fd, _CONTROL_BYTES, mmap.MAP_SHARED) as control:
                magic, version, area_bytes = _HEADER.unpack_from(control, _HEADER_OFFSET)
            if magic != MAGIC or version != MAILBOX_VERSION or not MIN_AREA_BYTES <= area_bytes <= MAX_AREA_BYTES \
                    or size != _CONTROL_BYTES + 2 * _area_span(area_bytes):
                raise MailboxUnavailable(f"not an omnigraph mailbox of version {MAILBOX_VERSION}: "
                                         f"{magic!r} version {version}, {size} bytes for areas of {area_bytes}")
            return cls(fd, area_bytes, controller=False)
        finally:
            os.close(fd)

    def close_fd(self) -> None:
        """Close the controller's copy of the descriptor (the worker holds its own mapping)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def announce(self, frame_bytes: int) -> None:
        """Ring the peer's doorbell for one message: the frame just written to the outbox
        (``frame_bytes`` long) or, with 0, one sent through the socket. The caller serialises its
        sends (one announcement per message, in order)."""
        self._posted += 1
        if frame_bytes:
            _SLOT.pack_into(self._control, self._out_slot, self._posted, frame_bytes)
        if self._libc.sem_post(self._peer_bell):
            raise OSError(ctypes.get_errno(), f"sem_post: {os.strerror(ctypes.get_errno())}")

    def receive(self, spin_us: int, deadline: float | None, peer: socket.socket) -> int | None:
        """Take one post of this side's doorbell and say where its message is: the length of the
        frame in the inbox, or 0 when the message is on the socket; None once ``deadline``
        (time.monotonic) has passed with no post. Polls for up to ``spin_us`` first (yielding the
        CPU every SPIN_YIELD_S), then sleeps. Raises PeerClosed when the peer's socket hangs up with
        nothing posted."""
        trywait, bell = self._libc.sem_trywait, self._bell
        if trywait(bell):
            now = time.perf_counter()
            end, next_yield = now + spin_us / 1e6, now + SPIN_YIELD_S
            while (now := time.perf_counter()) < end:
                if trywait(bell) == 0:
                    break
                if now >= next_yield:
                    os.sched_yield()
                    next_yield = now + SPIN_YIELD_S
            else:  # no post while polling
                if not self._sleep_for_post(deadline, peer):
                    return None
        self._taken += 1
        number, length = _SLOT.unpack_from(self._control, self._in_slot)
        return length if number == self._taken else 0

    def _sleep_for_post(self, deadline: float | None, peer: socket.socket) -> bool:
        """Sleep on this side's doorbell until a post (True) or ``deadline`` (False), looking for a
        hung-up peer between slices of PEER_CHECK_S."""
        trywait, bell = self._libc.sem_trywait, self._bell
        hang_up = select.poll()
        hang_up.register(peer, 0)  # hang-ups and errors only
        while True:
            pause = PEER_CHECK_S if deadline is None else min(PEER_CHECK_S, deadline - time.monotonic())
            if pause <= 0:
                return trywait(bell) == 0
            if self._sleep(pause):
                return True
            if hang_up.poll(0):
                if trywait(bell) == 0:  # the peer posted, then went
                    return True
                raise wire.PeerClosed("the peer hung up")

    def _sleep(self, seconds: float) -> bool:
        """Sleep on this side's doorbell for up to ``seconds``; True when a post was taken."""
        monotonic = hasattr(self._libc, "sem_clockwait")
        until = (time.clock_gettime(time.CLOCK_MONOTONIC) if monotonic else time.time()) + seconds
        when = ctypes.byref(_Timespec(int(until), int((until % 1) * 1e9)))
        while True:
            if monotonic:
                taken = self._libc.sem_clockwait(self._bell, time.CLOCK_MONOTONIC, when) == 0
            else:
                taken = self._libc.sem_timedwait(self._bell, when) == 0
            if taken:
                return True
            code = ctypes.get_errno()
            if code == errno.ETIMEDOUT:
                return False
            if code != errno.EINTR:
                raise OSError(code, f"waiting on the mailbox: {os.strerror(code)}")


def send_message(sock: socket.socket, mailbox: Mailbox | None, msg_type: str, *, request_id: str, stage_id: int,
                 epoch: int, generation: int, instance: str, body: Mapping[str, Any] | None,
                 tensors: Mapping[str, Any] | None, max_payload_bytes: int, shm_threshold_bytes: int,
                 binary: bool) -> None:
    """Send one message the way the peer reads it: a binary run or result that fits the mailbox
    through the mailbox, anything else through the socket (wire.encode_frame); with a mailbox,
    announced either way, before the socket send so that the peer reads while a large frame goes
    out. Refuses (a WireError, before anything is written or sent) what the receiver would refuse.
    The caller serialises its sends."""
    length = None
    if mailbox is not None and binary and not body and msg_type in wire.BINARY_MESSAGE_TYPES:
        length = wire.write_binary_frame(
            mailbox.outbox, msg_type, request_id=request_id, stage_id=stage_id, epoch=epoch, generation=generation,
            instance=instance, tensors=tensors or {}, max_payload_bytes=max_payload_bytes,
            shm_threshold_bytes=shm_threshold_bytes,
        )
    if length is not None:
        mailbox.announce(length)  # type: ignore[union-attr]
        return
    with wire.encode_frame(
        msg_type, request_id=request_id, stage_id=stage_id, epoch=epoch, generation=generation, instance=instance,
        body=body, tensors=tensors, max_payload_bytes=max_payload_bytes, shm_threshold_bytes=shm_threshold_bytes,
        binary=binary,
    ) as frame:
        if mailbox is not None:
            mailbox.announce(0)
        frame.send(sock)
