"""Server-sent events as the API writes them (cluster/ingress/responses.py)."""

import json

import httpx

from cluster.ingress.protocol import ChatCompletionChunk
from cluster.ingress.responses import sse


def test_sse_data_stays_one_line_for_every_line_splitter():
    """Generated text may hold U+2028, U+2029 or U+0085, which str.splitlines (httpx's iter_lines)
    treats as line ends: the event must still be one data line that parses to the same text."""
    text = "a\u2028b\u2029c\x85d\x1ce\nf\rg \u00e9\u4e2d"
    for payload in ({"text": text}, ChatCompletionChunk.model_validate(
            {"id": "x", "created": 0, "model": "m",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})):
        event = sse(payload)
        assert event.endswith("\n\n")
        lines = [line for line in event.splitlines() if line]
        assert len(lines) == 1 and lines[0].startswith("data: ")
        decoded = json.loads(lines[0][len("data: "):])
        got = decoded["text"] if isinstance(payload, dict) else decoded["choices"][0]["delta"]["content"]
        assert got == text
        stream = httpx.Response(200, content=event.encode())
        assert [line for line in stream.iter_lines() if line] == lines
