"""Text-block hashes of a request's prompt, so the request router can tell where its prefix is cached.

The router sees a request's text, not its tokens (it runs inside every ``DeploymentHandle`` and never
loads a tokenizer), so the engine's token-block hashes (:mod:`workers.prefix_hash`) are out of its
reach. Both sides therefore hash the same canonical *routing text* instead:

- the request's ``cache_salt`` (JSON-quoted), then either its raw prompt, or each chat message as
  canonical JSON (role first, the other keys sorted) with the tools (JSON) right after a leading
  system/developer message (where chat templates and :mod:`workers.models.tool_prompt` render them),
  before the first message otherwise; the parts joined by a separator that JSON never contains raw;
- cut into full blocks of ``TEXT_BLOCK_CHARS`` characters (a trailing partial block has no hash), at
  most ``MAX_BLOCKS`` of them;
- hashed as a chain (BLAKE2b, 8 bytes, as an int): block ``i``'s hash covers block ``i``'s characters
  and block ``i - 1``'s hash, so one hash stands for the whole prefix before it (vLLM's scheme).

The chat template renders messages in order, so equal routing-text prefixes render to equal token
prefixes up to the last message boundary they share: a replica that prefilled a request with routing
text ``T`` holds the KV of any request whose routing text shares a prefix with ``T`` (to within a block).

A replica keeps the hashes of the prompts it served in a :class:`PrefixIndex`, each with the prompt
tokens up to its block's end (from that prompt's own characters per token), and reports the recent
ones in its routing stats; :func:`cached_tokens` is the router's side. Plain data, no torch.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping

TEXT_BLOCK_CHARS = 128
"""Characters per hashed block: about 32 tokens of English text, two KV blocks of 16 tokens."""

MAX_BLOCKS = 1024
"""Blocks hashed per prompt at most (128K characters): the router hashes on the ingress's event loop."""

DIGEST_SIZE = 8
DEFAULT_CHARS_PER_TOKEN = 4.0
"""Routing-text characters per prompt token where the router has only the text to go by."""

MAX_REPORTED = 4096
"""Most hashes a replica reports (about 512K characters of cached prompt text; a few tens of KB per poll)."""

_SEP = "\x1e"  # ASCII record separator: escaped inside JSON strings, so it never occurs in the JSON parts
_LEADING_ROLES = ("system", "developer")


def _message_json(m: dict) -> str:
    return json.dumps([m.get("role"), {k: v for k, v in m.items() if k != "role"}], sort_keys=True,
                      ensure_ascii=False, default=str)


def routing_text(prompt: str | None, messages: list[dict] | None, tools: list[dict] | None = None,
                 cache_salt: str | None = None) -> str:
    """The canonical text a request's prefix is hashed over (see the module docstring). Exactly one
    of ``prompt`` and ``messages`` is expected; a raw prompt and a chat never share a prefix."""
    head = json.dumps(cache_salt, ensure_ascii=False) + _SEP
    if messages is None:
        return head + "p" + _SEP + (prompt or "")
    parts = [_message_json(m) for m in messages]
    if tools:
        lead = 1 if messages and isinstance(messages[0], dict) and messages[0].get("role") in _LEADING_ROLES else 0
        parts.insert(lead, json.dumps(tools, sort_keys=True, ensure_ascii=False, default=str))
    return head + "c" + _SEP + "".join(p + _SEP for p in parts)


def text_block_hashes(text: str, block_chars: int = TEXT_BLOCK_CHARS, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """Chain hashes of the full ``block_chars``-character blocks of ``text``, at most ``max_blocks``
    (see the module docstring)."""
    out, parent = [], b""
    for i in range(min(len(text) // block_chars, max_blocks)):
        block = text[i * block_chars: (i + 1) * block_chars].encode("utf-8", "surrogatepass")
        parent = hashlib.blake2b(parent + block, digest_size=DIGEST_SIZE).digest()
        out.append(int.from_bytes(parent, "little"))
    return out


def cached_tokens(hashes: list[int], held: Mapping[int, int] | None) -> int:
    """Prompt tokens of a request with routing-text ``hashes`` that a replica holding ``held`` (hash ->
    prompt tokens up to the end of its block) has cached: those of the longest prefix whose last block's
    hash it holds (a chain hash stands for its whole prefix). 0 when ``held`` is empty, None or not a
    mapping of numbers (stats from another version)."""
    if not held or not isinstance(held, Mapping):
        return 0
    for h in reversed(hashes):
        tokens = held.get(h)
        if tokens is not None:
            try:
                return max(int(tokens), 0)
            except (TypeError, ValueError, OverflowError):
                return 0
    return 0


def block_tokens(hashes: list[int], tokens_per_char: float, block_chars: int = TEXT_BLOCK_CHARS) -> dict[int, int]:
    """``{hash: prompt tokens up to its block's end}`` for a prompt's hashes at ``tokens_per_char``."""
    return {h: round((i + 1) * block_chars * tokens_per_char) for i, h in enumerate(hashes)}


class PrefixIndex:
    """The routing-text block hashes of the prompts a replica prefilled, least recently used first,
    each with the prompt tokens up to its block's end.

    A prompt's hashes are added leaf first, so its first block is the most recent: trimming from the
    old end drops the tails of chains before their roots, as the engine's cache (which evicts the
    least recently released block) loses them.

    :meth:`report` gives the most recent hashes whose blocks fit the engine's cached tokens: both sides
    evict least recently used, so the recent hashes approximate what the engine still holds.
    """

    def __init__(self, capacity: int = 4 * MAX_REPORTED):
        self.capacity = capacity
        self._tokens: OrderedDict[int, tuple[int, int]] = OrderedDict()  # hash -> (tokens to its end, its own)
        self._version = 0
        self._report: tuple[int, int, dict[int, int]] = (-1, -1, {})

    def add(self, hashes: list[int], prompt_tokens: int, text_chars: int) -> None:
        """A prompt of ``prompt_tokens`` tokens whose routing text (``text_chars`` characters) has these
        hashes was admitted (its prompt blocks enter the prefix cache)."""
        if not hashes or prompt_tokens <= 0 or text_chars <= 0:
            return
        per_char = prompt_tokens / text_chars
        ends = block_tokens(hashes, per_char)
        own = max(round(TEXT_BLOCK_CHARS * per_char), 1)
        for h in reversed(hashes):
            self._tokens[h] = (ends[h], own)
            self._tokens.move_to_end(h)
        while len(self._tokens) > self.capacity:
            self._tokens.popitem(last=False)
        self._version += 1

    def __len__(self) -> int:
        return len(self._tokens)

    def report(self, cached_tokens: int) -> dict[int, int]:
        """The most recent hashes (at most ``MAX_REPORTED``) whose blocks' tokens add up to no more than
        ``cached_tokens``, each with its prompt tokens up to its block's end."""
        if self._report[:2] != (self._version, cached_tokens):
            out, total = {}, 0
            for h in reversed(self._tokens):
                end, own = self._tokens[h]
                total += own
                if total > cached_tokens or len(out) >= MAX_REPORTED:
                    break
                out[h] = end
            self._report = (self._version, cached_tokens, out)
        return self._report[2]
