"""Request ids a client and an operator share: `X-Request-Id` in, the same id out.

A client's `X-Request-Id` is taken when it is usable (else the server makes one); it is echoed on
the answer (`X-Request-Id`), put in a decision route's error body (`request_id`) and starts the
engine's id for the request (`<client id>.<8 hex>`: unique even when a client reuses its id), so
the server's log lines about the request carry it. `current_request_id` holds it for the rest of
the request's task, where uvicorn writes the access line (`plugin/logs.py` appends it there).
"""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

from starlette.requests import Request

REQUEST_ID_HEADER = "X-Request-Id"
# Why: the id goes into headers and log lines; 128 visible characters without spaces or quotes
# hold every common scheme (UUIDs, ULIDs, trace ids) and nothing that could forge a log line.
_USABLE = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
_STATE_KEY = "omnigraph_request_id"
#: The id of the request whose task is running (uvicorn runs each request in a task of its own).
current_request_id: ContextVar[str | None] = ContextVar("omnigraph_request_id", default=None)


def request_id(request: Request) -> str:
    """The id this request is known by: the client's `X-Request-Id` when usable, else `req-<32 hex>`."""
    known = request.scope.setdefault("state", {}).get(_STATE_KEY)
    if known is None:
        given = request.headers.get(REQUEST_ID_HEADER)
        known = given if given is not None and _USABLE.fullmatch(given) else f"req-{uuid.uuid4().hex}"
        request.scope["state"][_STATE_KEY] = known
        current_request_id.set(known)
    return known


def engine_request_id(request: Request) -> str:
    """A fresh id for one engine request of this HTTP request, led by its request id."""
    return f"{request_id(request)}.{uuid.uuid4().hex[:8]}"
