"""The FastAPI app factory: decision routes, OpenAI routes and operational routes over one service.

The app starts listening before the engine is up: the engine starts (and warms up) in the
background, `/ready` answers 503 with Retry-After until it has, and `/health` reports a failure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnigraph.plugin.api import decision, openai_routes, probes
from omnigraph.plugin.api.auth import BearerKeyAuth
from omnigraph.plugin.api.body import MAX_BODY_BYTES
from omnigraph.plugin.api.docs import add_offline_docs
from omnigraph.plugin.api.errors import ERROR_CODE_STATE, ApiError, api_error_handler, unexpected_error_handler
from omnigraph.plugin.api.metrics import DECISION_ROUTES, EngineReadings, ServerMetrics
from omnigraph.plugin.api.routing import PlainRoute
from omnigraph.plugin.api.service import DecisionService


class RequestMetrics:
    """ASGI middleware counting every HTTP response by route template and status, with its latency;
    a decision route's answer also as an outcome ("ok", or the code of its `ApiError`, which
    `counted_api_error` and `BearerKeyAuth` leave in the request's state). A decision route
    refused before routing (401) is counted under its path. Prompt tokens are counted where each
    decision is in hand (handling.run_decision), not read back from the answer.

    `metrics` None: the app's own (`app.state.metrics`, which `attach_service` sets when vLLM
    starts the plugin); with `paths`, only requests to those paths are counted (inside vLLM:
    omnigraph's routes, not vLLM's)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics | None = None, *,
                 paths: frozenset[str] | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        metrics = self.metrics or getattr(getattr(scope.get("app"), "state", None), "metrics", None)
        if scope["type"] != "http" or metrics is None or (self.paths is not None and scope["path"] not in self.paths):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        state = scope.setdefault("state", {})  # the dict `request.state` writes to, further in
        status = 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = getattr(scope.get("route"), "path", None) or _unrouted(scope["path"])
            metrics.observe_request(route, status, time.perf_counter() - started)
            if route in DECISION_ROUTES:
                _observe_outcome(metrics, status, state.get(ERROR_CODE_STATE))


def _observe_outcome(metrics: ServerMetrics, status: int, code: str | None) -> None:
    if 200 <= status < 300:
        metrics.observe_outcome("ok")
    else:  # a 500 no handler of ours answered is an unexpected error's
        metrics.observe_outcome(code or ("internal_error" if status == 500 else f"http_{status}"))


def _unrouted(path: str) -> str:
    """The route label of a request answered before routing: a decision route's own path (a fixed
    set, so no label grows with what clients send), anything else "unmatched"."""
    return path if path in DECISION_ROUTES else "unmatched"


async def counted_api_error(request: Request, error: Exception) -> Response:
    """`api_error_handler`, leaving the error's code for the middleware's outcome count."""
    if isinstance(error, ApiError):
        setattr(request.state, ERROR_CODE_STATE, error.code)
    return await api_error_handler(request, error)


def attach_service(state: Any, service: DecisionService, *, max_body_bytes: int = MAX_BODY_BYTES,
                   registry: CollectorRegistry | None = None, drain_refused_bytes: int = 0) -> None:
    """Put on `state` (an app's, or vLLM's) what the routes read: the service, its metrics, the
    body cap, how much of an over-cap body to drain before its 413 (handling.read_json) and the
    start time."""
    state.service = service
    state.drain_refused_bytes = drain_refused_bytes
    readings = EngineReadings(queue_depth=service.queue_depth, engine=service.metrics,
                              requests_by_phase=service.requests_by_phase, stage_names=service.stage_names)
    state.metrics = ServerMetrics(service.model_name, readings, registry=registry)
    state.max_body_bytes = max_body_bytes
    state.started_at = int(time.time())


def build_app(service: DecisionService, *, max_body_bytes: int = MAX_BODY_BYTES,
              on_startup_failure: Callable[[str], None] | None = None, api_key: str | None = None) -> FastAPI:
    """An app serving `service`; `on_startup_failure(reason)` is called if the engine cannot start;
    with `api_key`, every route but the probes needs it as a bearer key (auth.py)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def start() -> None:
            await service.start()
            if service.failure is not None and on_startup_failure is not None:
                on_startup_failure(service.failure)

        starting = asyncio.create_task(start())
        try:
            yield
        finally:
            starting.cancel()
            try:
                await starting
            except asyncio.CancelledError:
                pass
            await service.stop()

    app = FastAPI(title="omnigraph", summary="System One decisions over HTTP", lifespan=lifespan,
                  docs_url=None, redoc_url=None)  # add_offline_docs serves /docs without a CDN
    add_offline_docs(app)
    attach_service(app.state, service, max_body_bytes=max_body_bytes)
    app.add_exception_handler(ApiError, counted_api_error)
    app.add_exception_handler(Exception, unexpected_error_handler)
    app.include_router(decision.router)
    app.include_router(openai_routes.router)
    app.include_router(probes.router)
    app.router.add_api_route("/v1/systemone/ready", probes.ready, methods=["GET"],  # its path inside vLLM
                             route_class_override=PlainRoute)
    if api_key is not None:
        app.add_middleware(BearerKeyAuth, api_key=api_key)  # inside the metrics: a 401 is counted
    app.add_middleware(RequestMetrics, metrics=app.state.metrics)
    app.state.metrics.count_outcomes()
    return app
