"""The decision routes, wire-compatible with laya-serve: `POST /v1/systemone` and its batch sibling.

The request body goes to the model's processor as it is (minus `model`): the processor validates
the whole of it before anything reaches a stage, so its field names and limits live in one place.
Every answer carries an `audit` object saying what produced it, in the System One schema:
`model_hash`, `adapter_hash` (null when there is none), `calibration_version`, `backend`,
`precision`, then the lists in question order `prompt_template_sha256`, `allowed_token_set_hash`
and `input_tokens`. A batch answers one result per state, in order: `{"id", "answers", "usage",
"audit"}` or `{"id", "error": {"code", "message", "field"}}`.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from omnigraph.plugin.api.errors import ApiError
from omnigraph.plugin.api.handling import cancel_on_disconnect, read_json, run_decision
from omnigraph.plugin.api.request_ids import REQUEST_ID_HEADER, engine_request_id, request_id
from omnigraph.plugin.api.request_schemas import BATCH_REQUEST, DECISION_REQUEST, request_body
from omnigraph.plugin.api.routing import PlainRoute
from omnigraph.plugin.api.service import Decision, DecisionService

MAX_BATCH_STATES = 64

router = APIRouter(route_class=PlainRoute)


def _names_a_path(text: str) -> bool:
    """True when `text` is written as a filesystem path or a `org/repo` id (a slash or backslash,
    or a leading `.` or `~`), not as a model name: laya-serve's test for the same refusal."""
    return text[:1] in (".", "~") or "/" in text or "\\" in text


def check_model(body: dict, service: DecisionService) -> None:
    """`model` is optional. One of the served names (or the pipeline's own) is this model; so is a
    client's own model id that names no checkpoint (a Jev client's `jev-latest`): as laya-serve has
    it, that is "no explicit model", answered by the served model. Refused (422 naming `model`):
    a value that is not a string, a path, or another checkpoint this server knows of and does not
    serve (another installed pipeline)."""
    model = body.get("model")
    if model is None or (isinstance(model, str) and (not model.strip() or service.serves(model))):
        return
    if not isinstance(model, str):
        raise ApiError(422, f"model must be a string, got {type(model).__name__}", code="invalid_request",
                       field="model")
    text = model.strip()
    if service.serves(text):
        return
    if _names_a_path(text):
        raise ApiError(422, f"model {model!r} is a path or repository id; this server loads no model per request "
                            f"and serves {service.model_name!r}: omit model or send {service.model_name!r}",
                       code="model_not_found", field="model")
    from omnigraph.pipelines.registry import available_pipelines

    if text.casefold() in {name.casefold() for name in available_pipelines()}:
        raise ApiError(422, f"unknown model {model!r}: this server serves {service.model_name!r}, not that "
                            f"checkpoint; omit model or send {service.model_name!r}",
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


@router.post("/v1/systemone", openapi_extra=request_body(DECISION_REQUEST))
async def systemone(request: Request) -> JSONResponse:
    service: DecisionService = request.app.state.service
    body = _object_body(await read_json(request, request.app.state.max_body_bytes))
    check_model(body, service)
    service.check_available()
    prompt = {key: value for key, value in body.items() if key != "model"}
    decision = await cancel_on_disconnect(request, run_decision(request, prompt, engine_request_id(request)))
    return JSONResponse(answer_body(service, decision), headers={REQUEST_ID_HEADER: request_id(request)})


async def _batch_item(request: Request, prompt: dict, request_id: str, hold: Any) -> dict:
    """One state's result: `{"id", "answers", "usage", "audit"}`, or `{"id", "error": {"code",
    "message", "field"}}` for its own failure, which fails only itself."""
    try:
        answer = answer_body(request.app.state.service, await run_decision(request, prompt, request_id, hold=hold))
    except ApiError as error:
        return {"id": request_id, "error": {"code": error.code, "message": error.message, "field": error.field}}
    return {"id": request_id, "answers": answer["answers"], "usage": answer["usage"], "audit": answer["audit"]}


def _batch_audit(service: DecisionService, answered: list[dict]) -> dict:
    """The batch's audit in the single route's schema: the shared questions in order, each with
    its input tokens summed over the states that answered."""
    if not answered:
        return service.response_audit({})
    audit = dict(answered[0]["audit"])
    audit["input_tokens"] = [sum(tokens) for tokens in zip(*(result["audit"]["input_tokens"] for result in answered),
                                                            strict=True)]
    return audit


@router.post("/v1/systemone/batch", openapi_extra=request_body(BATCH_REQUEST))
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
                         "audit": _batch_audit(service, answered)}, headers={REQUEST_ID_HEADER: request_id(request)})
