"""Bearer-key access to `omnigraph serve`, as vLLM's `--api-key` and laya-serve's `LAYA_API_KEY` do.

With a key set, every route but the probes (health, readiness, metrics: a load balancer and
Prometheus reach those without credentials) needs `Authorization: Bearer <key>`. The key is
compared in constant time; a wrong or missing one gets 401 in the route family's error shape and
learns nothing else (not which part was wrong, not whether the route exists). Pure ASGI: the
check runs before any body is read.
"""

from __future__ import annotations

import hmac
import json
import os

from starlette.types import ASGIApp, Receive, Scope, Send

from omnigraph.plugin.api.errors import (
    ERROR_CODE_STATE,
    ApiError,
    decision_error_body,
    is_openai_path,
    openai_error_body,
)

API_KEY_ENV = "OMNIGRAPH_API_KEY"
OPEN_PATHS = frozenset({"/health", "/ready", "/v1/systemone/ready", "/metrics"})
_UNAUTHORIZED = ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'", code="unauthorized")


def api_key_from_env() -> str | None:
    """`OMNIGRAPH_API_KEY`, or None when unset; an empty one is refused (it would lock nothing)."""
    key = os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"{API_KEY_ENV} is set but empty; unset it to serve without a key")
    return key


class BearerKeyAuth:
    """ASGI middleware: HTTP requests outside OPEN_PATHS need the bearer key."""

    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body_shape = openai_error_body if is_openai_path(scope["path"]) else decision_error_body
        body = json.dumps(body_shape(_UNAUTHORIZED)).encode()
        scope.setdefault("state", {})[ERROR_CODE_STATE] = _UNAUTHORIZED.code  # the outcome count's
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        return hmac.compare_digest(given, self._expected)
