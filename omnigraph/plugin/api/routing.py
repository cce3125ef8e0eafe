"""`PlainRoute`: a FastAPI route served as Starlette serves its own, its OpenAPI entry as declared.

FastAPI's `APIRoute` runs each request through its dependency solver, its body and response-model
steps and a context stack for dependencies with `yield`, about 50 us a request on the 2-core
machine (a FastAPI app with one route of each kind, same process, same client). omnigraph's
routes use none of it: each takes the `Request`, returns a `Response`, and raises `ApiError` for
the app's exception handlers. A `PlainRoute` keeps what the declaration gives (path, methods,
`openapi_extra`, its place in `/openapi.json` and in vLLM's view of plugin routes) and calls the
endpoint through Starlette's `request_response`, which keeps route-level exception handling.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.routing import request_response

Endpoint = Callable[[Request], Awaitable[Response]]


class PlainRoute(APIRoute):
    """An `APIRoute` whose endpoint is called with the request and sends the response it returns."""

    def __init__(self, path: str, endpoint: Endpoint, **kwargs: Any) -> None:
        super().__init__(path, endpoint, **kwargs)
        self.app = request_response(endpoint)
