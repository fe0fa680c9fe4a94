"""Build OpenAI responses and stream chunks from engine deltas, for chat and text completions.

Both formats share one shape so the ingress streams either the same way: optional opening chunks
(chat sends ``delta: {"role": "assistant"}`` first), one chunk per delta with text (or with logprobs:
a token whose text is withheld still gets its logprobs as it is emitted), exactly one chunk with a
non-null ``finish_reason`` (carrying the ``rdserve`` stats), then, with
``stream_options.include_usage``, a ``choices: []`` chunk with the usage.

Logprobs (:class:`workers.outputs.TokenLogprob`) take OpenAI's chat shape (``logprobs.content``) or
its legacy completions shape (parallel lists with ``text_offset``); vLLM's ``prompt_logprobs`` is a
list with one ``{token_id: {logprob, rank, decoded_token}}`` per prompt token (None first).
A logprob below ``LOGPROB_FLOOR`` is written as the floor (JSON has no -Infinity; vLLM's choice).
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
    ChatLogprobEntry,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCall,
    PromptLogprob,
    PromptTokensDetails,
    RdserveStats,
    ToolCall,
    TopLogprobEntry,
    Usage,
)
from cluster.ingress.tools import ToolCallStream, parse_tool_calls
from cluster.ingress.messages import Started


LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_logprobs(entries) -> ChatLogprobs:
    """OpenAI's chat ``logprobs`` of output tokens (``TokenLogprob`` entries)."""
    return ChatLogprobs(content=[ChatLogprobEntry(
        token=e.token, logprob=_lp(e.logprob), bytes=e.bytes,
        top_logprobs=[TopLogprobEntry(token=t.token, logprob=_lp(t.logprob), bytes=t.bytes) for t in e.top])
        for e in entries])


def prompt_logprobs_of(entries) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, the token and its top alternatives by id."""
    out = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        tokens = {str(t.token_id): PromptLogprob(logprob=_lp(t.logprob), rank=rank, decoded_token=t.token)
                  for rank, t in enumerate(e.top, start=1)}
        tokens[str(e.token_id)] = PromptLogprob(logprob=_lp(e.logprob), rank=e.rank, decoded_token=e.token)
        out.append(tokens)
    return out


def _call(call: dict) -> ToolCall:
    return ToolCall(id=call["id"], type="function", function=FunctionCall(**call["function"]))


def usage_of(last) -> Usage:
    """Usage from the final engine delta (its counters are cumulative)."""
    return Usage(prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
                 total_tokens=last.prompt_tokens + last.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=getattr(last, "cached_tokens", 0)))


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
    """Chat completions. ``logprobs`` / ``prompt_logprobs`` arguments: the engine's entries, or None
    when the request did not ask for them. ``tools``: the request's tool calls are parsed out of the
    text (:mod:`cluster.ingress.tools`); ``finish_reason`` is then ``tool_calls`` when the reply made
    any and ended by itself."""

    model: str
    tools: ToolCallStream | None = None
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, text: str, finish_reason: str | None, usage: Usage, stats: RdserveStats,
                 logprobs=None, prompt_logprobs=None) -> BaseModel:
        message = AssistantMessage(content=text)
        if self.tools is not None:
            content, calls = parse_tool_calls(text)
            message = AssistantMessage(content=content, tool_calls=[_call(c) for c in calls] or None)
            finish_reason = "tool_calls" if calls and finish_reason == "stop" else finish_reason
        choice = ChatChoice(message=message, finish_reason=finish_reason,
                            logprobs=None if logprobs is None else chat_logprobs(logprobs))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                      usage=usage, rdserve=stats,
                                      prompt_logprobs=None if prompt_logprobs is None else prompt_logprobs_of(prompt_logprobs))

    def opening_chunks(self) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(delta={"role": "assistant", "content": ""})])]

    def chunk(self, text: str, finish_reason: str | None = None, stats: RdserveStats | None = None,
              logprobs=None, prompt_logprobs=None) -> BaseModel:
        calls = []
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if finish_reason is not None:
                rest, _ = self.tools.finish()
                text += rest
                finish_reason = "tool_calls" if self.tools.calls and finish_reason == "stop" else finish_reason
        delta = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = [{"index": c["index"], "id": c["id"], "type": "function",
                                "function": c["function"]} for c in calls]
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason,
                                 logprobs=None if logprobs is None else chat_logprobs(logprobs))
        chunk = self._chunk([choice], rdserve=stats)
        if prompt_logprobs is not None:  # vLLM sends them on the first chunk, beside the choices
            chunk.prompt_logprobs = prompt_logprobs_of(prompt_logprobs)
        return chunk

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage=usage)

    def _chunk(self, choices: list[ChatChunkChoice], **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **extra)


@dataclass
class CompletionFormat:
    """Text completions. ``echo``: the prompt text, put before the output (``echo: true``), its
    tokens' logprobs before the output's when logprobs are asked for. ``show_prompt_logprobs``:
    the request asked for vLLM's ``prompt_logprobs`` field."""

    model: str
    echo: str | None = None
    show_prompt_logprobs: bool = False
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    _offset: int = 0  # characters of text sent so far (text_offset of the next token)
    _echoed: bool = False

    def response(self, text: str, finish_reason: str | None, usage: Usage, stats: RdserveStats,
                 logprobs=None, prompt_logprobs=None) -> BaseModel:
        return self._make([self._choice(text, finish_reason, logprobs, prompt_logprobs)], usage=usage, rdserve=stats)

    def opening_chunks(self) -> list[BaseModel]:
        return []

    def chunk(self, text: str, finish_reason: str | None = None, stats: RdserveStats | None = None,
              logprobs=None, prompt_logprobs=None) -> BaseModel:
        return self._make([self._choice(text, finish_reason, logprobs, prompt_logprobs)], rdserve=stats)

    def _choice(self, text: str, finish_reason: str | None, logprobs, prompt_logprobs) -> CompletionChoice:
        entries = logprobs
        if self.echo is not None and not self._echoed:  # the first chunk (or the response) carries the prompt
            self._echoed = True
            text = self.echo + text
            if logprobs is not None and prompt_logprobs is not None:
                entries = list(prompt_logprobs) + list(logprobs)
        choice = CompletionChoice(text=text, finish_reason=finish_reason,
                                  logprobs=None if entries is None else self._logprobs(entries))
        if self.show_prompt_logprobs and prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs_of(prompt_logprobs)
        return choice

    def _logprobs(self, entries) -> CompletionLogprobs:
        tokens, values, tops, offsets = [], [], [], []
        for e in entries:
            tokens.append(e.token)
            offsets.append(self._offset)
            self._offset += len(e.token)
            if e.logprob is None:  # the prompt's first token: nothing predicts it
                values.append(None)
                tops.append(None)
                continue
            values.append(_lp(e.logprob))
            tops.append({t.token: _lp(t.logprob) for t in e.top})
        return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._make([], usage=usage)

    def _make(self, choices: list[CompletionChoice], **extra) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, **extra)
