"""The floor of HTTP on a machine, for laya_gpu.py's http path: a bare ASGI app under uvicorn (the
same httptools protocol and event loop `omnigraph serve` runs on) that parses each request's JSON
body and sends the same bytes back, with no framework, middleware, validation or engine.

With an `X-Echo-Delay-Us` header it answers that many microseconds later, woken as a worker's reply
wakes `omnigraph serve`: a thread sleeps out the delay and wakes the event loop. Given the engine's
own latency, that is the floor of HTTP for a request that takes as long (the client and the server
sleep through it, and a sleeper wakes more slowly than a busy one on some hosts).

    python -m uvicorn benchmarks.http_echo:app --port PORT --http httptools --no-access-log
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

DELAY_HEADER = b"x-echo-delay-us"


def _delay_s(headers: list[tuple[bytes, bytes]]) -> float:
    return next((int(value) / 1e6 for name, value in headers if name == DELAY_HEADER), 0.0)


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
    delay = _delay_s(scope["headers"])
    if delay:
        await asyncio.get_running_loop().run_in_executor(None, time.sleep, delay)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
