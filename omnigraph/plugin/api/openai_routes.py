"""OpenAI-compatible routes: `POST /v1/chat/completions` (structured outputs only) and `GET /v1/models`.

A streamed request gets the same result as a plain one, as server-sent events: a role chunk, one
content chunk carrying the whole JSON answer (and its logprobs), a finish chunk, an optional usage
chunk (`stream_options.include_usage`), then `data: [DONE]`. The decision is computed before the
first byte is sent, so every failure still answers with a real status and OpenAI's error body.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from omnigraph.plugin.api.decision import MAX_BATCH_STATES
from omnigraph.plugin.api.errors import ApiError
from omnigraph.plugin.api.handling import cancel_on_disconnect, read_json, run_decision
from omnigraph.plugin.api.openai_protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChunkChoice,
    Delta,
    ModelCard,
    ModelList,
    Usage,
)
from omnigraph.plugin.api.openai_schema import (
    completion_content,
    decision_prompt,
    openai_invalid,
    parse_chat_request,
    plan_decisions,
)
from omnigraph.plugin.api.request_ids import REQUEST_ID_HEADER, engine_request_id, request_id
from omnigraph.plugin.api.request_schemas import chat_completion_request, request_body
from omnigraph.plugin.api.routing import PlainRoute
from omnigraph.plugin.api.service import DecisionService

router = APIRouter(route_class=PlainRoute)


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    """OpenAI's model list, one entry per served name (the first is the name answers carry), each
    also a System One model entry."""
    return JSONResponse(ModelList(data=model_cards(request)).model_dump())


def model_cards(request: Request) -> list[ModelCard]:
    """The app's served model as OpenAI model objects carrying System One's fields, one per served name."""
    service: DecisionService = request.app.state.service
    server_limits = {"max_batch_states": MAX_BATCH_STATES, "max_body_bytes": request.app.state.max_body_bytes}
    return [ModelCard(id=card["name"], created=request.app.state.started_at, **card)
            for card in service.model_cards(server_limits)]


def _sse(chunk: ChatCompletionChunk) -> str:
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


def _stream(completion: ChatCompletion, include_usage: bool) -> Iterator[str]:
    choice = completion.choices[0]
    common: dict[str, Any] = {"id": completion.id, "created": completion.created, "model": completion.model}
    yield _sse(ChatCompletionChunk(**common, choices=[ChunkChoice(delta=Delta(role="assistant", content=""))]))
    yield _sse(ChatCompletionChunk(**common, choices=[ChunkChoice(delta=Delta(content=choice.message.content),
                                                                  logprobs=choice.logprobs)]))
    yield _sse(ChatCompletionChunk(**common, choices=[ChunkChoice(delta=Delta(), finish_reason="stop")]))
    if include_usage:
        yield _sse(ChatCompletionChunk(**common, choices=[], usage=completion.usage))
    yield "data: [DONE]\n\n"


@router.post("/v1/chat/completions", openapi_extra=request_body(chat_completion_request()))
async def chat_completions(request: Request):
    service: DecisionService = request.app.state.service
    chat = parse_chat_request(await read_json(request, request.app.state.max_body_bytes))
    if not service.serves(chat.model):
        raise ApiError(404, f"the model {chat.model!r} does not exist; this server serves {service.model_name!r}",
                       code="model_not_found", field="model")
    plan = plan_decisions(chat)
    service.check_available()
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    try:
        decision = await cancel_on_disconnect(request, run_decision(request, decision_prompt(chat, plan),
                                                                    engine_request_id(request)))
    except ApiError as error:
        raise openai_invalid(error) if error.status == 422 else error from None
    content, logprobs = completion_content(plan, decision.response["answers"], chat.top_logprobs or 0)
    prompt_tokens = int(decision.response["usage"]["input_tokens"])
    completion = ChatCompletion(
        id=completion_id, created=int(time.time()), model=service.model_name,
        choices=[Choice(message=AssistantMessage(content=content), logprobs=logprobs if chat.logprobs else None)],
        usage=Usage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        audit=service.response_audit(decision.response),
    )
    if chat.stream:
        include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
        return StreamingResponse(_stream(completion, include_usage), media_type="text/event-stream",
                                 headers={REQUEST_ID_HEADER: request_id(request)})
    return JSONResponse(completion.model_dump(), headers={REQUEST_ID_HEADER: request_id(request)})

