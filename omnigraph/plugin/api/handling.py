"""What every POST route does around its own logic: read a strict JSON body, run the decision, and
stop work whose client has gone away."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect

from omnigraph.plugin.api.body import BodyError, check_content_type, drain, parse_strict_json, read_capped
from omnigraph.plugin.api.errors import ApiError
from omnigraph.plugin.api.service import Decision

T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"; only ever logged

# uvicorn writes no access line for a response it cannot send, so a hang-up gets its own line there.
access_log = logging.getLogger("uvicorn.access")


async def read_json(request: Request, max_bytes: int) -> Any:
    """The parsed body: 415 for a non-JSON content type, 413 past `max_bytes`, 400 for unusable JSON.

    A 413's unread rest is drained first where the server cannot close a connection gracefully
    (the app state's `drain_refused_bytes`, set inside `vllm serve`): closing with unread bytes
    resets the connection, and the client never reads its 413. `omnigraph serve`'s connections do
    a lingering close themselves (connections.py)."""
    try:
        check_content_type(request.headers.get("content-type"))
        raw = await read_capped(request.stream(), request.headers.get("content-length"), max_bytes)
        return parse_strict_json(raw)
    except BodyError as error:
        refused = ApiError.from_body_error(error)
        if error.status == 413 and await _drained(request):
            refused.headers = {}  # the whole body was read: the connection can carry the next request
        raise refused from None
    except ClientDisconnect:
        raise client_went_away(request, "while sending its body") from None


async def _drained(request: Request) -> bool:
    limit = getattr(request.app.state, "drain_refused_bytes", 0)
    try:
        return limit > 0 and await drain(request.stream(), limit)
    except ClientDisconnect:
        return False


def client_went_away(request: Request, when: str) -> ApiError:
    """Count a hang-up as a disconnect (not a server error), log one access line, and return the 499."""
    request.app.state.metrics.disconnects.inc()
    client = request.client
    address = f"{client.host}:{client.port}" if client else "-"
    access_log.info('%s - "%s %s HTTP/%s" %d', address, request.method, request.url.path,  # uvicorn's format
                    request.scope.get("http_version", "1.1"), CLIENT_CLOSED_REQUEST)
    return ApiError(CLIENT_CLOSED_REQUEST, f"the client disconnected {when}; the request was aborted",
                    code="client_disconnected")


async def run_decision(request: Request, prompt: dict, request_id: str, *, hold: Any = None) -> Decision:
    """One decision through the app's service (admitted through `hold`, a batch's queue slots,
    when given), its stage times and prompt tokens recorded in the app's metrics."""
    decision = await request.app.state.service.decide(prompt, request_id=request_id, hold=hold)
    metrics = request.app.state.metrics
    metrics.observe_stages(decision.stage_durations)
    metrics.observe_prompt_tokens(decision.response["usage"]["input_tokens"])
    return decision


async def _wait_for_disconnect(request: Request) -> None:
    # The body is fully read before this runs, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` in the route's own task; a client that disconnects first cancels it (its
    cleanup aborts the request) and gets the 499. The answer reaches the route with no task in
    between: each hop between tasks is a turn of the event loop, which costs a system call on a
    host where those are dear (gVisor's)."""
    route = asyncio.current_task()
    assert route is not None, "a route runs in a task"
    state = {"answered": False, "disconnected": False}

    async def listen() -> None:
        await _wait_for_disconnect(request)
        if not state["answered"]:
            state["disconnected"] = True
            route.cancel()

    listener = asyncio.ensure_future(listen())
    try:
        result = await work
        state["answered"] = True
        return result
    except asyncio.CancelledError:
        if not state["disconnected"]:
            raise  # the route itself is cancelled (the server shuts down)
        route.uncancel()  # the listener's own cancellation: answered with the 499 below
    finally:
        listener.cancel()
    raise client_went_away(request, "before its answer was ready")
