"""The decision routes, wire-compatible with laya-serve: `POST /v1/systemone` and its batch sibling.

The request body goes to the model's processor as it is (minus `model`): the processor validates
the whole of it before anything reaches a stage, so its field names and limits live in one place.
Every answer carries an `audit` object saying what produced it.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from omnigraph.plugin.api.errors import ApiError, decision_error_body
from omnigraph.plugin.api.handling import cancel_on_disconnect, read_json, run_decision
from omnigraph.plugin.api.service import Decision, DecisionService

MAX_BATCH_STATES = 64

router = APIRouter()


def check_model(body: dict, service: DecisionService) -> None:
    """`model` is optional; when given it must name the served model (422 naming `model`)."""
    model = body.get("model")
    if model is not None and model != service.model_name:
        raise ApiError(422, f"unknown model {model!r}; this server serves {service.model_name!r}",
                       code="model_not_found", field="model")


def _object_body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ApiError(422, f"request body must be a JSON object, not {type(body).__name__}", code="invalid_request")
    return body


def answer_body(service: DecisionService, decision: Decision) -> dict:
    """The processor's response with the served model's name and the audit of what produced it."""
    response = dict(decision.response)
    response["model"] = service.model_name
    response["audit"] = service.response_audit(decision.response)
    return response


@router.post("/v1/systemone")
async def systemone(request: Request) -> JSONResponse:
    service: DecisionService = request.app.state.service
    body = _object_body(await read_json(request, request.app.state.max_body_bytes))
    check_model(body, service)
    service.check_available()
    prompt = {key: value for key, value in body.items() if key != "model"}
    decision = await cancel_on_disconnect(request, run_decision(request, prompt, f"sys-{uuid.uuid4().hex}"))
    return JSONResponse(answer_body(service, decision))


async def _batch_item(request: Request, prompt: dict, request_id: str, hold: Any) -> dict:
    """One state's answer, or its own error (`status`, `detail`, `field`): one failure fails only itself."""
    try:
        return answer_body(request.app.state.service, await run_decision(request, prompt, request_id, hold=hold))
    except ApiError as error:
        return {"status": error.status, **decision_error_body(error)}


@router.post("/v1/systemone/batch")
async def systemone_batch(request: Request) -> JSONResponse:
    service: DecisionService = request.app.state.service
    body = _object_body(await read_json(request, request.app.state.max_body_bytes))
    check_model(body, service)
    states = body.get("states")
    if not isinstance(states, list) or not states:
        raise ApiError(422, "states must be a non-empty array of states", code="invalid_request", field="states")
    if len(states) > MAX_BATCH_STATES:
        raise ApiError(422, f"too many states ({len(states)} > {MAX_BATCH_STATES})", code="invalid_request",
                       field="states")
    service.check_available()
    shared = {key: value for key, value in body.items() if key not in ("model", "states")}
    batch_id = uuid.uuid4().hex
    with service.hold(len(states)) as hold:  # admitted as a unit: the whole batch, or a 503 for all of it
        items = [_batch_item(request, {**shared, "state": state}, f"batch-{batch_id}-{index}", hold)
                 for index, state in enumerate(states)]
        results = await cancel_on_disconnect(request, asyncio.gather(*items))
    answered = [result for result in results if "answers" in result]
    total_usage = {key: sum(result["usage"].get(key, 0) for result in answered)
                   for key in ("input_tokens", "output_tokens")}
    return JSONResponse({"model": service.model_name, "results": list(results), "total_usage": total_usage,
                         "audit": service.audit()})
