"""Build OpenAI responses and stream chunks from engine deltas, for chat and text completions.

Both formats share one shape so the ingress streams either the same way: optional opening chunks
(chat sends ``delta: {"role": "assistant"}`` first), one chunk per non-empty text delta, exactly one
chunk with a non-null ``finish_reason`` (carrying the ``rdserve`` stats), then, with
``stream_options.include_usage``, a ``choices: []`` chunk with the usage.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from pydantic import BaseModel

from cluster.ingress.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    RdserveStats,
    Usage,
)
from cluster.ingress.messages import Started


def usage_of(last) -> Usage:
    """Usage from the final engine delta (its counters are cumulative)."""
    return Usage(prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
                 total_tokens=last.prompt_tokens + last.completion_tokens)


def stats_of(started: Started, last) -> RdserveStats:
    """Router decision and serving replica, plus speculation counters from the final engine delta."""
    return RdserveStats(mode=started.mode, reason=started.reason, num_steps=last.num_steps,
                        accepted_draft_tokens=last.accepted_draft_tokens,
                        tokens_per_step=round(last.tokens_per_step, 4), replica=started.replica)


# Characters Python's str.splitlines (and so httpx's iter_lines and other clients' line readers) takes
# for line ends although SSE does not: left raw in generated text they would cut a data line in two.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event: ``data: <json>\\n\\n``. The JSON is on one line for every line
    splitter: U+2028, U+2029 and U+0085 in strings are written as JSON escapes (the same values;
    control characters are escaped by JSON itself)."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data.translate(_LINE_BREAKS)}\n\n"


@dataclass
class ChatFormat:
    model: str
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, text: str, finish_reason: str | None, usage: Usage, stats: RdserveStats) -> BaseModel:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                      usage=usage, rdserve=stats)

    def opening_chunks(self) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(delta={"role": "assistant", "content": ""})])]

    def chunk(self, text: str, finish_reason: str | None = None, stats: RdserveStats | None = None) -> BaseModel:
        delta = {"content": text} if text else {}
        return self._chunk([ChatChunkChoice(delta=delta, finish_reason=finish_reason)], rdserve=stats)

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage=usage)

    def _chunk(self, choices: list[ChatChunkChoice], **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **extra)


@dataclass
class CompletionFormat:
    model: str
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, text: str, finish_reason: str | None, usage: Usage, stats: RdserveStats) -> BaseModel:
        return self._make([CompletionChoice(text=text, finish_reason=finish_reason)], usage=usage, rdserve=stats)

    def opening_chunks(self) -> list[BaseModel]:
        return []

    def chunk(self, text: str, finish_reason: str | None = None, stats: RdserveStats | None = None) -> BaseModel:
        return self._make([CompletionChoice(text=text, finish_reason=finish_reason)], rdserve=stats)

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._make([], usage=usage)

    def _make(self, choices: list[CompletionChoice], **extra) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, **extra)
