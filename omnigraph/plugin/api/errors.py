"""HTTP errors and their two body shapes.

Decision routes answer like laya-serve (`{"detail": ...}`, plus `field` when one field is to
blame), so its clients keep parsing errors unchanged; OpenAI routes answer in OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`) so the official client raises its own
exception classes.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from omnigraph.plugin.api.body import BodyError
from omnigraph.plugin.api.request_ids import REQUEST_ID_HEADER, request_id

logger = logging.getLogger("omnigraph.plugin.api")

OPENAI_PATH_PREFIXES = ("/v1/chat/", "/v1/models")
#: Where an error answered for a request leaves its code for the metrics middleware's outcome count
#: (in the ASGI scope's state, which `request.state` writes to).
ERROR_CODE_STATE = "omnigraph_error_code"

_OPENAI_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class ApiError(Exception):
    """An HTTP error a route raises; `field` is the dotted name of the one input at fault, if any."""

    def __init__(self, status: int, message: str, *, code: str, field: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.field = field
        self.headers = headers or {}

    @classmethod
    def from_body_error(cls, error: BodyError) -> ApiError:
        # An over-limit body is left unread: the connection cannot carry another request after it.
        headers = {"Connection": "close"} if error.status == 413 else None
        return cls(error.status, error.message, code=error.code, headers=headers)


def decision_error_body(error: ApiError) -> dict[str, Any]:
    body: dict[str, Any] = {"detail": error.message}
    if error.field is not None:
        body["field"] = error.field
    return body


def openai_error_body(error: ApiError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": _OPENAI_TYPES.get(error.status, "invalid_request_error"),
                      "param": error.field, "code": error.code}}


def is_openai_path(path: str) -> bool:
    return path.startswith(OPENAI_PATH_PREFIXES)


async def api_error_handler(request: Request, error: Exception) -> JSONResponse:
    """The error in its route family's shape, with the request's id (`X-Request-Id`; a decision
    route's body also carries it as `request_id`), and a log line naming the id, so an operator
    finds the answer a client reports: INFO for the client's fault, WARNING for the server's."""
    assert isinstance(error, ApiError)
    shared = request_id(request)
    logger.log(logging.WARNING if error.status >= 500 else logging.INFO, "request %s: %s %s %d %s: %s%s",
               shared, request.method, request.url.path, error.status, error.code,
               "" if error.field is None else f"{error.field}: ", error.message)
    if is_openai_path(request.url.path):
        body = openai_error_body(error)
    else:
        body = {**decision_error_body(error), "request_id": shared}
    return JSONResponse(body, status_code=error.status, headers={**error.headers, REQUEST_ID_HEADER: shared})


async def unexpected_error_handler(request: Request, error: Exception) -> JSONResponse:
    """A bug still answers in the route family's JSON shape (the traceback goes to the log)."""
    return await api_error_handler(request, ApiError(500, "internal server error", code="internal_error"))
