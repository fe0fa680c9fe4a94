"""The endpoint under test: base URL, served model name, and how to count output tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True)
class Target:
    """``base_url`` without ``/v1`` (e.g. ``http://127.0.0.1:8000``); ``count_tokens(text) -> tokens``
    with the model's tokenizer, or None to trust the server's ``usage``."""

    base_url: str
    model: str
    count_tokens: Callable[[str], int] | None = None


def served_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model id of ``GET /v1/models``.

    Raises:
        RuntimeError: the endpoint is unreachable or lists no model.
    """
    try:
        resp = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=timeout_s)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
        raise RuntimeError(f"{base_url}/v1/models: cannot read the served model ({err})") from None


def tokenizer_counter(tokenizer_dir: str | Path) -> Callable[[str], int]:
    """``text -> number of tokens`` with the tokenizer stored in a local model directory."""
    from workers.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])
