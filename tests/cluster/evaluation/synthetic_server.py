"""A synthetic OpenAI-compatible streaming server with known delays, run in a background thread.

Every streamed completion waits ``first_s`` before its first content chunk, then ``gap_s`` before
each of the remaining ``chunks - 1`` chunks (one word, i.e. one token, each), then sends the usage
chunk and ``[DONE]``. Requests are served concurrently (no queueing), so client-side figures are
known in closed form.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route


@dataclass(frozen=True)
class Delays:
    first_s: float
    gap_s: float
    chunks: int


def _app(delays: Delays) -> Starlette:
    async def completions(request):
        body = await request.json()

        async def events():
            await asyncio.sleep(delays.first_s)
            for k in range(delays.chunks):
                if k:
                    await asyncio.sleep(delays.gap_s)
                last = k == delays.chunks - 1
                chunk = {"choices": [{"index": 0, "text": f"w{k} ", "finish_reason": "length" if last else None}]}
                if last:
                    chunk["rdserve"] = {"mode": (body.get("rdserve") or {}).get("mode") or "plain", "reason": "x",
                                        "num_steps": delays.chunks - 1, "accepted_draft_tokens": 0,
                                        "tokens_per_step": 1.0}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": 3, "completion_tokens": delays.chunks, "total_tokens": 3 + delays.chunks}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


class SyntheticServer:
    """``with SyntheticServer(Delays(...)) as url:`` serves on a free port of 127.0.0.1."""

    def __init__(self, delays: Delays):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(_app(delays), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("synthetic server did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
