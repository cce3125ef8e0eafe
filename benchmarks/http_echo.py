"""The floor of HTTP on a machine, for laya_gpu.py's http path: a bare ASGI app under uvicorn (the
same httptools protocol and event loop `omnigraph serve` runs on) that parses each request's JSON
body and sends the same bytes back, with no framework, middleware, validation or engine.

With an `X-Echo-Delay-Us` header it answers that many microseconds later, woken as a worker's reply
wakes `omnigraph serve`: a thread sleeps out the delay and wakes the event loop. Given the engine's
own latency, that is the floor of HTTP for a request that takes as long (the client and the server
sleep through it, and a sleeper wakes more slowly than a busy one on some hosts). With
`X-Echo-Poll: 1` as well, the event loop polls through the delay instead of sleeping. The answer's
`X-Echo-Held-Us` says how long the server held it.

    python -m uvicorn benchmarks.http_echo:app --port PORT --http httptools --no-access-log
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

DELAY_HEADER = b"x-echo-delay-us"
SPIN_HEADER = b"x-echo-poll"  # "1": wait out the delay with the event loop polling, never sleeping
HELD_HEADER = b"x-echo-held-us"  # the time the answer was held, as the server measured it


async def _polling(seconds: float) -> None:
    """Wait with the event loop kept polling (a callback always ready, so its selector never sleeps)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    until = time.perf_counter() + seconds

    def poll() -> None:
        if time.perf_counter() < until:
            loop.call_soon(poll)
        else:
            done.set_result(None)

    loop.call_soon(poll)
    await done


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
    held = time.perf_counter()
    delay = _delay_s(scope["headers"])
    if delay and (SPIN_HEADER, b"1") in scope["headers"]:
        await _polling(delay)
    elif delay:
        await asyncio.get_running_loop().run_in_executor(None, time.sleep, delay)
    held_us = str(round(1e6 * (time.perf_counter() - held))).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (HELD_HEADER, held_us)]})
    await send({"type": "http.response.body", "body": body})
