"""HTTP/1.1 connections that cannot starve the server: read deadlines, a connection bound, lingering close.

uvicorn (httptools) has no deadline on reading a request head or body, accepts connections until
the process runs out of file descriptors, and closes a `Connection: close` response at once even
when the client is still sending its body, so the kernel resets the connection over the unread
bytes and the client never reads the answer (typically a 413). `GuardedHttpProtocol` adds, per
connection, one deadline at a time:

- waiting for a request head (from accept, or from the previous response): `head_timeout_s`,
  then 408 and close; a head larger than `MAX_HEAD_BYTES` is a 431;
- reading a body: `body_timeout_s` without a byte, then 408 and close;
- after a response sent before its request body was read in full (a 413, a 415): the rest of
  the body is read and dropped for at most `linger_s`; a kept-alive connection then serves the
  next request, and a `Connection: close` one shuts its write side first (the client reads the
  whole answer) and closes when the client does or when `linger_s` is up.

Past `max_connections` open connections, the one that has waited longest for a request head is
closed (503): idle and half-sent connections give way to new clients instead of locking them out.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

#: A request head larger than this is refused (431): real heads are a few hundred bytes, and
#: httptools itself never stops a client that sends headers forever.
MAX_HEAD_BYTES = 64 * 1024


@dataclass(frozen=True)
class ConnectionLimits:
    """Deadlines (seconds) and the open-connection bound of one server."""

    max_connections: int
    head_timeout_s: float
    body_timeout_s: float
    linger_s: float


def _canned_response(status: int, reason: str, detail: str, *, retry_after: int | None = None) -> bytes:
    """A complete `Connection: close` response written by the connection itself (no app involved)."""
    body = json.dumps({"detail": detail}).encode()
    retry = b"" if retry_after is None else b"retry-after: %d\r\n" % retry_after
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%sconnection: close\r\n\r\n"
            % (status, reason.encode(), len(body), retry) + body)


_HEAD_TIMEOUT = _canned_response(408, "Request Timeout", "the request head did not arrive in time")
_BODY_TIMEOUT = _canned_response(408, "Request Timeout", "the request body stopped arriving")
_HEAD_TOO_LARGE = _canned_response(431, "Request Header Fields Too Large",
                                   f"the request head exceeds {MAX_HEAD_BYTES} bytes")
_SHED = _canned_response(503, "Service Unavailable", "too many open connections; retry", retry_after=1)


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head over `MAX_HEAD_BYTES`."""


class _CycleTransport:
    """What a request's response cycle writes through. Its writes within one turn of the event loop
    go out as one: uvicorn writes a response's head and its body separately, and two sends cost the
    client two wake-ups (a batch-1 answer's largest host cost after the model on a gVisor host). Its
    `close()` sends what is held, then lingers while the body is unread."""

    def __init__(self, protocol: GuardedHttpProtocol) -> None:
        self._protocol = protocol
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._held:
            self._protocol.loop.call_soon(self._send_held)
        self._held.append(data)

    def _send_held(self) -> None:
        if self._held:
            data = b"".join(self._held)
            self._held.clear()
            if not self._protocol.transport.is_closing():
                self._protocol.transport.write(data)

    def is_closing(self) -> bool:
        return self._protocol.transport.is_closing()

    def close(self) -> None:
        self._send_held()
        self._protocol.close_after_response()


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol under `ConnectionLimits`; `waiting` is shared by one server's
    connections: those with no request in progress, oldest first (the ones shed first)."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, limits: ConnectionLimits,
                 waiting: dict[GuardedHttpProtocol, None]) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._limits = limits
        self._waiting = waiting
        self._deadline: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # bytes received while waiting for the request head
        self._parsed_head_bytes = 0  # bytes of the head's URL and headers, as parsed
        self._reading_body = False
        self._lingering = False

    # -- the one deadline a connection is under ----------------------------------------------------

    def _set_deadline(self, seconds: float | None, expire: Callable[[], None] | None = None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None if seconds is None or expire is None else self.loop.call_later(seconds, expire)

    def _refuse(self, response: bytes) -> None:
        """Answer with a canned response and close (used when no app response is in progress)."""
        self._waiting.pop(self, None)
        self._set_deadline(None)
        if not self.transport.is_closing():
            self.transport.write(response)
            self.transport.close()

    def _await_request(self) -> None:
        self._head_bytes = self._parsed_head_bytes = 0
        self._waiting[self] = None
        self._set_deadline(self._limits.head_timeout_s, partial(self._refuse, _HEAD_TIMEOUT))

    def _body_timed_out(self) -> None:
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()  # the app is answering already: nothing more can be said
        else:
            self._refuse(_BODY_TIMEOUT)

    # -- uvicorn's protocol hooks ------------------------------------------------------------------

    # a stream server hands it an asyncio.Transport; asyncio.Protocol declares the wider BaseTransport
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_request()
        if len(self.connections) > self._limits.max_connections:
            oldest = next(iter(self._waiting))  # this connection itself when every other one is busy
            # Its descriptor is released when the loop next runs; stop counting it now.
            self.connections.discard(oldest)
            oldest._refuse(_SHED)

    def connection_lost(self, exc: Exception | None) -> None:
        self._waiting.pop(self, None)
        self._set_deadline(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the rest of a body already answered: discarded
        if self in self._waiting:
            self._head_bytes += len(data)
        super().data_received(data)
        if self in self._waiting and self._head_bytes > MAX_HEAD_BYTES:  # a head still arriving
            self._refuse(_HEAD_TOO_LARGE)

    def on_url(self, url: bytes) -> None:
        self._parsed_head_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._parsed_head_bytes += len(name) + len(value)
        if self._parsed_head_bytes > MAX_HEAD_BYTES:  # a whole head that came in one read
            raise _HeadTooLarge  # stops the parser; uvicorn then calls send_400_response
        super().on_header(name, value)

    def send_400_response(self, msg: str) -> None:
        if self._parsed_head_bytes > MAX_HEAD_BYTES:
            self._refuse(_HEAD_TOO_LARGE)
        else:
            super().send_400_response(msg)

    def on_headers_complete(self) -> None:
        self._waiting.pop(self, None)
        self._reading_body = True
        self._set_deadline(self._limits.body_timeout_s, self._body_timed_out)
        super().on_headers_complete()  # always starts a cycle: the server speaks no upgrades (ws="none")
        # not an asyncio.Transport: a stand-in whose close() lingers while the body is unread
        self.cycle.transport = _CycleTransport(self)  # type: ignore[assignment]

    def on_body(self, body: bytes) -> None:
        if not self.cycle.response_complete:  # a body read after its answer keeps the linger deadline
            self._set_deadline(self._limits.body_timeout_s, self._body_timed_out)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._reading_body = False
        self._set_deadline(None)
        super().on_message_complete()
        if self.cycle.response_complete:  # the rest of an answered body is read: ready for the next
            self._await_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing() or self._lingering:
            return
        if self._reading_body:  # answered early on a kept-alive connection: the rest of the body is
            self._unset_keepalive_if_required()  # dropped as it comes, for at most `linger_s`
            self._set_deadline(self._limits.linger_s, self.transport.close)
        elif self.cycle.response_complete:  # no pipelined request started
            self._await_request()

    def close_after_response(self) -> None:
        """Close now, or, while the client may still be sending the body, linger: shut our side (the
        client reads the whole answer), discard what it sends, close when it does or after `linger_s`."""
        if not self._reading_body or self.transport.is_closing() or not self.transport.can_write_eof():
            self._set_deadline(None)
            self.transport.close()
            return
        if self._lingering:
            return
        self._lingering = True
        self.flow.resume_reading()
        self.transport.write_eof()
        self._set_deadline(self._limits.linger_s, self.transport.close)


def guarded_protocol_factory(limits: ConnectionLimits) -> Callable[..., GuardedHttpProtocol]:
    """What uvicorn's `Config(http=...)` takes: protocols of one server, sharing its waiting list."""
    waiting: dict[GuardedHttpProtocol, None] = {}
    return partial(GuardedHttpProtocol, limits=limits, waiting=waiting)
