"""The floor of HTTP on a machine, for laya_gpu.py's http path: a bare ASGI app under uvicorn (the
same httptools protocol and event loop `omnigraph serve` runs on) that parses each request's JSON
body and sends the same bytes back, with no framework, middleware, validation or engine.

    python -m uvicorn benchmarks.http_echo:app --port PORT --http httptools --no-access-log
"""

from __future__ import annotations

import json
from typing import Any


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if body:
        json.loads(body)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
