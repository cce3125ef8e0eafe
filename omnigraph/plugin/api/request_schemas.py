"""The decision routes' request bodies as JSON Schemas, for the OpenAPI document (`/openapi.json`,
`/docs`) only. The routes read their bodies as strict JSON and validate them with the pipeline's own
parser (pipelines/system_one/request.py), whose errors name the offending field; these schemas
describe that contract to clients and tools."""

from __future__ import annotations

from typing import Any

from omnigraph.plugin.api.openai_protocol import ChatCompletionRequest

_LABEL = {"type": ["string", "integer", "number", "boolean"]}
QUESTION: dict[str, Any] = {
    "type": "object",
    "required": ["type", "instructions"],
    "additionalProperties": False,
    "properties": {
        "type": {"enum": ["noul", "choice", "score"],
                 "description": "noul: no or yes; choice: one of named options; score: one of ordered levels"},
        "instructions": {"description": "what the model answers (a string, or a JSON object or list)",
                         "type": ["string", "object", "array", "integer", "number"]},
        "criteria": {
            "description": "choice: an object of label -> description, or a list of labels; score: a list of "
                           "level descriptions, lowest first; noul: optional 'true' / 'false' descriptions",
            "oneOf": [{"type": "object"}, {"type": "array", "items": _LABEL}],
        },
        "labels": {"description": "noul only: how the two answers are worded, [false, true]",
                   "type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 2},
        "option_order": {"description": "the order the options are shown in: a permutation of their indices",
                         "type": "array", "items": {"type": "integer", "minimum": 0}},
    },
}
_STATE = {"description": "what is decided about: text, a JSON object, or a list of conversation turns "
                         "(the newest kept when it is too long)",
          "type": ["string", "object", "array"]}
_MODEL = {"type": "string", "description": "optional: the served model's name, an alias, or a client's own id"}
_QUESTIONS = {"type": "object", "additionalProperties": QUESTION,
              "description": "question id -> question, answered in this order"}
DECISION_REQUEST: dict[str, Any] = {
    "type": "object", "required": ["state", "questions"], "additionalProperties": False,
    "properties": {"model": _MODEL, "state": _STATE, "questions": _QUESTIONS},
    "example": {"state": "Please refund the duplicate charge.",
                "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}},
}
BATCH_REQUEST: dict[str, Any] = {
    "type": "object", "required": ["states", "questions"], "additionalProperties": False,
    "properties": {"model": _MODEL, "states": {"type": "array", "items": _STATE, "minItems": 1},
                   "questions": _QUESTIONS},
}


def request_body(schema: dict[str, Any]) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON request body described by `schema`."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def chat_completion_request() -> dict[str, Any]:
    """The structured-output chat request's schema, its `$defs` inlined (a `$ref` inside a route's
    body would resolve against the whole OpenAPI document)."""
    schema = ChatCompletionRequest.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(definitions[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    return inline(schema)
