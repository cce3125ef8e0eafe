"""`omnigraph serve`: the HTTP server over one pipeline.

`serve` resolves which pipeline is served (the deploy YAML's, the named one, or the embedded demo
Laya), builds the app over an `AsyncOmni` that starts in the background, and runs uvicorn until
stopped. A pipeline that cannot start stops the server with `ServerStartupError`, so the command
exits non-zero with the reason instead of serving 503s forever.

Environment: `OMNIGRAPH_REQUEST_DEADLINE_S` (default 30) bounds each request, queueing included.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import uvicorn

from omnigraph.plugin.api.app import build_app
from omnigraph.plugin.api.service import DEFAULT_DEADLINE_S, DecisionService

if TYPE_CHECKING:
    from omnigraph.stages.native_client import ServedEngine

DEADLINE_ENV = "OMNIGRAPH_REQUEST_DEADLINE_S"


class ServerStartupError(RuntimeError):
    """The pipeline behind the server failed to start or to pass its warmup request."""


def request_deadline_from_env() -> float:
    """Seconds each request may take (queueing included), from `OMNIGRAPH_REQUEST_DEADLINE_S`."""
    raw = os.environ.get(DEADLINE_ENV, "").strip()
    if not raw:
        return DEFAULT_DEADLINE_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{DEADLINE_ENV} must be a number of seconds, got {raw!r}") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"{DEADLINE_ENV} must be positive and finite, got {raw!r}")
    return value


def served_model_name(model: str | None, deploy_config: str | None) -> str:
    """The name clients use: the deploy YAML's pipeline, the named pipeline, or the default."""
    if deploy_config is not None:
        from omnigraph.pipelines.deploy import load_deploy_config

        return load_deploy_config(deploy_config).pipeline
    from omnigraph.plugin.omni import DEFAULT_MODEL

    return model or DEFAULT_MODEL


def build_service(model: str | None, *, bundle: str | None = None, deploy_config: str | None = None,
                  deadline_s: float = DEFAULT_DEADLINE_S, served_engine: ServedEngine | None = None) -> DecisionService:
    """A service whose engine is an `AsyncOmni` built (in a thread) when the app starts;
    `served_engine` (inside `vllm serve`) is the vLLM engine a native stage uses."""
    from omnigraph.plugin.omni import AsyncOmni

    def start_engine() -> AsyncOmni:
        # The service sends the warmup request itself, through the same async path requests take.
        return AsyncOmni(model=model, deploy_config=deploy_config, bundle=bundle, warmup=False,
                         served_engine=served_engine)

    return DecisionService(start_engine, model_name=served_model_name(model, deploy_config), deadline_s=deadline_s)


def serve(model: str | None, *, bundle: str | None, deploy_config: str | None, host: str, port: int) -> None:
    """Serve `model` on `host:port` until interrupted; raises `ServerStartupError` if it cannot start."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    service = build_service(model, bundle=bundle, deploy_config=deploy_config,
                            deadline_s=request_deadline_from_env())
    failures: list[str] = []
    server: uvicorn.Server

    def stop_on_failure(reason: str) -> None:
        failures.append(reason)
        server.should_exit = True

    app = build_app(service, on_startup_failure=stop_on_failure)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=5))
    server.run()
    if failures:
        raise ServerStartupError(failures[0])
