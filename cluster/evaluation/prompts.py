"""Evaluation prompts: a JSONL file, one row per line, and the OpenAI request body for a row.

A row has exactly one of ``prompt`` (raw text, sent to ``/v1/completions``) and ``messages`` (chat,
sent to ``/v1/chat/completions``), a ``category`` (default ``"general"``), and optionally
``reference`` (e.g. a GSM8K answer ending in ``#### N``) and ``stop`` (stop strings).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/v1/completions"


class PromptFileError(ValueError):
    """A malformed prompt file; the message names ``file:line``."""


@dataclass(frozen=True)
class PromptRow:
    category: str
    prompt: str | None = None
    messages: list[dict] | None = None
    reference: str | None = None
    stop: list[str] = field(default_factory=list)

    @property
    def path(self) -> str:
        return CHAT_PATH if self.messages is not None else COMPLETION_PATH

    @property
    def text(self) -> str:
        """The prompt as one string (the last user message for chat), for reports."""
        return self.prompt if self.messages is None else str(self.messages[-1].get("content", ""))

    def body(self, model: str, max_tokens: int, *, temperature: float = 0.0, mode: str | None = None,
             seed: int | None = None, stream: bool = False, logprobs: bool = False) -> dict:
        """The request body; ``mode`` goes into the ``rdserve`` extension (None = server default);
        ``logprobs``: ask for each output token's logprob (chat ``logprobs: true``, completions ``logprobs: 0``)."""
        body: dict = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": stream}
        if logprobs:
            body["logprobs"] = True if self.messages is not None else 0
        body.update({"messages": self.messages} if self.messages is not None else {"prompt": self.prompt})
        if stream:
            body["stream_options"] = {"include_usage": True}
        if mode is not None:
            body["rdserve"] = {"mode": mode}
        if seed is not None:
            body["seed"] = seed
        if self.stop:
            body["stop"] = self.stop
        return body


def load_prompts(path: str | Path) -> list[PromptRow]:
    """Read a prompt JSONL file (blank lines skipped).

    Raises:
        PromptFileError: unreadable file, invalid JSON, or a row without exactly one of
            ``prompt``/``messages``; the message names ``file:line``.
    """
    path = Path(path)
    try:
        lines = path.read_text().split("\n")
    except OSError as err:
        raise PromptFileError(f"{path}: cannot read ({err.strerror})") from None
    rows = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptFileError(f"{path}:{n}: invalid JSON ({err.msg})") from None
        if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
            raise PromptFileError(f"{path}:{n}: each line needs exactly one of 'prompt' and 'messages'")
        stop = item.get("stop") or []
        rows.append(PromptRow(category=str(item.get("category", "general")), prompt=item.get("prompt"),
                              messages=item.get("messages"), reference=item.get("reference"),
                              stop=[stop] if isinstance(stop, str) else list(stop)))
    if not rows:
        raise PromptFileError(f"{path}: no prompts")
    return rows
