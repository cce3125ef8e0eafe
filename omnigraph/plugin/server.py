"""`omnigraph serve`: the HTTP server over one pipeline.

`serve` resolves which pipeline is served (the deploy YAML's, the named one, or the embedded demo
Laya), builds the app over an `AsyncOmni` that starts in the background, and runs uvicorn until
stopped. A pipeline that cannot start stops the server with `ServerStartupError`, so the command
exits non-zero with the reason instead of serving 503s forever.

Environment: `OMNIGRAPH_REQUEST_DEADLINE_S` (default 30) bounds each request, queueing included.

Connections (`uvicorn_config`, `omnigraph.plugin.api.connections`), so that idle, slow or
half-sent clients cannot lock good ones out:
- `OMNIGRAPH_MAX_CONNECTIONS` (default: the open-file soft limit minus `RESERVED_FDS` minus
  `BACKLOG`): past it, the connection that has waited longest for a request head is closed (503);
  a value the file limit cannot hold is refused at startup.
- `OMNIGRAPH_HEAD_TIMEOUT_S` (default 10): time to send a request head (408 after).
- `OMNIGRAPH_BODY_TIMEOUT_S` (default 30): longest silence while sending a body (408 after).
- `OMNIGRAPH_LINGER_S` (default 5): after an answer sent before its body was read (413), how long
  the rest of the body is read and discarded so the client can read the answer.
- uvicorn's own `timeout_keep_alive` (5 s between requests) and `backlog` (`BACKLOG`).
"""

from __future__ import annotations

import errno
import logging.config
import os
import resource
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import uvicorn

from omnigraph.plugin.api.app import build_app
from omnigraph.plugin.api.auth import api_key_from_env
from omnigraph.plugin.api.connections import ConnectionLimits, guarded_protocol_factory
from omnigraph.plugin.api.service import DEFAULT_DEADLINE_S, DecisionService
from omnigraph.plugin.logs import log_probes_from_env, logging_config
from omnigraph.stages.startup import StartCancel

if TYPE_CHECKING:
    from omnigraph.stages.native_stage import ServedEngine

DEADLINE_ENV = "OMNIGRAPH_REQUEST_DEADLINE_S"

#: Descriptors kept for everything but client connections: the listening socket, worker pipes and
#: shared memory, bundle and log files (an idle demo server holds about 20).
RESERVED_FDS = 64
#: Connections the kernel may queue for accept; a burst of them is accepted before any is counted,
#: so the connection bound leaves this many descriptors free as well (uvicorn's default is 2048).
BACKLOG = 128
HEAD_TIMEOUT_S = 10.0  # a request head is a few hundred bytes: ten seconds is generous
BODY_TIMEOUT_S = 30.0  # silence while a body is being sent, as nginx's client_body_timeout
LINGER_S = 5.0  # time to finish sending a body already refused, so the refusal can be read
KEEP_ALIVE_S = 5  # uvicorn's default idle time between requests on one connection


class ServerStartupError(RuntimeError):
    """The pipeline behind the server failed to start or to pass its warmup request."""


def request_deadline_from_env() -> float:
    """Seconds each request may take (queueing included), from `OMNIGRAPH_REQUEST_DEADLINE_S`."""
    return _positive_env(DEADLINE_ENV, DEFAULT_DEADLINE_S)


def _positive_env(name: str, default: float) -> float:
    """A positive, finite number from the environment variable `name`, or `default` when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} must be positive and finite, got {raw!r}")
    return value


def connection_limits_from_env() -> ConnectionLimits:
    """The connection bound (derived from RLIMIT_NOFILE) and read deadlines, with env overrides."""
    soft_limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    most = soft_limit - RESERVED_FDS - BACKLOG
    if most < 1:
        raise ValueError(f"the open-file limit {soft_limit} leaves no room for connections; raise `ulimit -n`")
    max_connections = int(_positive_env("OMNIGRAPH_MAX_CONNECTIONS", most))
    if max_connections > most:
        raise ValueError(f"OMNIGRAPH_MAX_CONNECTIONS={max_connections} needs more than the open-file limit "
                         f"{soft_limit} allows (at most {most}); raise `ulimit -n` or lower it")
    return ConnectionLimits(max_connections=max_connections,
                            head_timeout_s=_positive_env("OMNIGRAPH_HEAD_TIMEOUT_S", HEAD_TIMEOUT_S),
                            body_timeout_s=_positive_env("OMNIGRAPH_BODY_TIMEOUT_S", BODY_TIMEOUT_S),
                            linger_s=_positive_env("OMNIGRAPH_LINGER_S", LINGER_S))


def uvicorn_config(app: Any, *, host: str, port: int) -> uvicorn.Config:
    """uvicorn's settings: httptools under the connection limits, a bounded backlog."""
    limits = connection_limits_from_env()
    return uvicorn.Config(app, host=host, port=port, log_config=logging_config(log_probes=log_probes_from_env()),
                          timeout_graceful_shutdown=5,
                          # uvicorn calls `http` as a protocol factory; its annotation names a class only
                          http=guarded_protocol_factory(limits),  # type: ignore[arg-type]
                          backlog=BACKLOG, timeout_keep_alive=KEEP_ALIVE_S,
                          ws="none")  # no websocket routes: an upgrade header is a plain request


def served_model_name(model: str | None, deploy_config: str | None) -> str:
    """The name clients use: the deploy YAML's pipeline, the named pipeline, or the default."""
    if deploy_config is not None:
        from omnigraph.pipelines.deploy import load_deploy_config

        return load_deploy_config(deploy_config).pipeline
    from omnigraph.plugin.omni import DEFAULT_MODEL

    return model or DEFAULT_MODEL


def build_service(model: str | None, *, bundle: str | None = None, deploy_config: str | None = None,
                  deadline_s: float = DEFAULT_DEADLINE_S, served_engine: ServedEngine | None = None,
                  served_model_names: Sequence[str] | None = None) -> DecisionService:
    """A service whose engine is an `AsyncOmni` built (in a thread) when the app starts;
    `served_engine` (inside `vllm serve`) is the vLLM engine a native stage uses;
    `served_model_names` are the names clients may use, the first the one answers carry (default:
    the pipeline's name)."""
    from omnigraph.plugin.omni import AsyncOmni

    def start_engine(cancel: StartCancel) -> AsyncOmni:
        # The service sends the warmup request itself, through the same async path requests take.
        return AsyncOmni(model=model, deploy_config=deploy_config, bundle=bundle, warmup=False,
                         served_engine=served_engine, cancel=cancel)

    return DecisionService(start_engine, model_name=served_model_name(model, deploy_config), deadline_s=deadline_s,
                           served_model_names=served_model_names or ())


def check_serve_arguments(model: str | None, bundle: str | None, deploy_config: str | None) -> None:
    """Refuse a pipeline, bundle or deploy YAML that cannot be served before anything starts or
    binds, naming the user's own argument (ServerStartupError). Cheap: reads names and manifests,
    builds and loads nothing (the engine's start does that, behind a listening port)."""
    from omnigraph.bundles import load_manifest
    from omnigraph.pipelines.deploy import load_deploy_config
    from omnigraph.pipelines.registry import get_pipeline

    checks: list[tuple[str, Callable[[], object]]] = []
    if model is not None:
        checks.append((f"model {model!r}", lambda: get_pipeline(model)))
    if bundle is not None:
        checks.append((f"--bundle {bundle}", lambda: load_manifest(bundle)))
    if deploy_config is not None:
        checks.append((f"--deploy-config {deploy_config}", lambda: load_deploy_config(deploy_config)))
    for argument, check in checks:
        try:
            check()
        except Exception as exc:
            raise ServerStartupError(f"{argument}: {exc}") from exc


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening; a port in use is one ServerStartupError line."""
    try:
        return socket.create_server((host, port), backlog=BACKLOG)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ServerStartupError(f"--port {port}: {host}:{port} is already in use") from None
        raise ServerStartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def serve(model: str | None, *, bundle: str | None, deploy_config: str | None, host: str, port: int,
          api_key: str | None = None,
          served_model_names: Sequence[str] = ()) -> None:
    """Serve `model` on `host:port` until interrupted; raises `ServerStartupError` if it cannot start.
    `api_key` (`--api-key`, else $OMNIGRAPH_API_KEY): the bearer key every route but the probes needs.
    `served_model_names` (`--served-model-name`): the names clients may use, the first the one
    answers carry."""
    check_serve_arguments(model, bundle, deploy_config)
    api_key = api_key if api_key is not None else api_key_from_env()
    sock = listening_socket(host, port)
    logging.config.dictConfig(logging_config(log_probes=log_probes_from_env()))
    service = build_service(model, bundle=bundle, deploy_config=deploy_config,
                            deadline_s=request_deadline_from_env(), served_model_names=served_model_names)
    failures: list[str] = []
    server: uvicorn.Server

    def stop_on_failure(reason: str) -> None:
        failures.append(reason)
        server.should_exit = True

    app = build_app(service, on_startup_failure=stop_on_failure, api_key=api_key)
    server = uvicorn.Server(uvicorn_config(app, host=host, port=port))
    server.run(sockets=[sock])
    if failures:
        raise ServerStartupError(failures[0])
