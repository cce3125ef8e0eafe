"""Inside `vllm serve`: vLLM's `GET /health` and `GET /v1/models` with omnigraph's System One fields.

A System One client and the conformance runner read the served model's facts from these two
routes, so they must say the same under both servers. vLLM lets an endpoint plugin replace a route
of the same path and method; each replacement here calls vLLM's own handler first and keeps what
it says:
- `/health`: vLLM's answer when it is not 200 (its engine is dead); else omnigraph's System One
  health body and status, as `omnigraph serve` answers it.
- `/v1/models`: vLLM's list, every entry kept; the entry whose id is one of omnigraph's served names
  also carries System One's fields (`name`, `description`, `release_date`, `avrik`), and a served
  name vLLM does not list is appended as `omnigraph serve` lists it.
Where vLLM has no such route (or one whose handler does not take the request alone, so it cannot
be called here), omnigraph's own is added.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from omnigraph.plugin.api import openai_routes, probes
from omnigraph.plugin.api.routing import Endpoint

#: A vLLM route handler: FastAPI lets it return a Response or any JSON-able value.
VllmHandler = Callable[[Request], Awaitable[Any]]


def overlay_routes(app: FastAPI) -> list[tuple[str, Endpoint]]:
    """The `(path, endpoint)` GET routes to add to vLLM's `app` for `/health` and `/v1/models`;
    the vLLM routes they call are taken off `app` (as vLLM itself replaces a plugin's paths)."""
    vllm_health, vllm_models = _take_vllm_handler(app, "/health"), _take_vllm_handler(app, "/v1/models")
    return [("/health", probes.health if vllm_health is None else _health_over(vllm_health)),
            ("/v1/models", openai_routes.models if vllm_models is None else _models_over(vllm_models))]


def _take_vllm_handler(app: FastAPI, path: str) -> VllmHandler | None:
    """vLLM's GET handler of `path`, its route taken off `app`, when it takes the request alone
    (vLLM's form); else None, and `app` is left as it was."""
    for route in app.routes:
        if isinstance(route, APIRoute) and route.path == path and route.methods == {"GET"}:
            if len(inspect.signature(route.endpoint).parameters) != 1:
                return None
            app.router.routes.remove(route)
            return route.endpoint
    return None


def _health_over(vllm_health: VllmHandler) -> Endpoint:
    async def health(request: Request) -> Response:
        """vLLM's answer while its engine is unhealthy, else the System One health body."""
        answer = await vllm_health(request)
        if not isinstance(answer, Response):  # FastAPI's form of a plain return value
            answer = JSONResponse(answer)
        return answer if answer.status_code != 200 else await probes.health(request)

    return health


def _models_over(vllm_models: VllmHandler) -> Endpoint:
    async def models(request: Request) -> Response:
        """vLLM's model list, omnigraph's served names on it with their System One fields."""
        listed = await vllm_models(request)
        if not isinstance(listed, Response):  # FastAPI's form of a plain return value
            listed = JSONResponse(listed)
        if not isinstance(listed, JSONResponse) or listed.status_code != 200:
            return listed
        body = json.loads(bytes(listed.body))
        entries = body.get("data") if isinstance(body, dict) else None
        if not isinstance(entries, list):
            return listed
        cards = {card.id: card.model_dump() for card in openai_routes.model_cards(request)}
        for entry in entries:
            if isinstance(entry, dict) and entry.get("id") in cards:
                card = cards.pop(entry["id"])
                entry.update({key: card[key] for key in ("name", "description", "release_date", "avrik")})
        entries.extend(cards.values())
        return JSONResponse(body)

    return models
