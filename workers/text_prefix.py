"""Text-block hashes of a request's prompt, so the request router can tell where its prefix is cached.

The router sees a request's text, not its tokens (it runs inside every ``DeploymentHandle`` and never
loads a tokenizer), so the engine's token-block hashes (:mod:`workers.prefix_hash`) are out of its
reach. Both sides therefore hash the same canonical *routing text* instead:

- the request's ``cache_salt``, its tools (JSON) and then either its raw prompt or each chat message as
  canonical JSON (``sort_keys``), joined by separators that cannot occur inside JSON;
- cut into full blocks of ``TEXT_BLOCK_CHARS`` characters (a trailing partial block has no hash);
- hashed as a chain (BLAKE2b, 8 bytes, as an int): block ``i``'s hash covers block ``i``'s characters
  and block ``i - 1``'s hash, so one hash stands for the whole prefix before it (vLLM's scheme).

The chat template renders messages in order, so equal routing-text prefixes render to equal token
prefixes up to the last message boundary they share: a replica that prefilled a request with routing
text ``T`` holds the KV of any request whose routing text shares a prefix with ``T`` (to within a block).

A replica keeps the hashes of the prompts it served in a :class:`PrefixIndex` and reports the recent
ones in its routing stats; :func:`cached_chars` is the router's side. Plain data, no torch.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable

TEXT_BLOCK_CHARS = 128
"""Characters per hashed block: about 32 tokens of English text, two KV blocks of 16 tokens."""

DIGEST_SIZE = 8
DEFAULT_CHARS_PER_TOKEN = 4.0
"""Routing-text characters per prompt token assumed before a replica has measured its own."""
MAX_REPORTED = 4096
"""Most hashes a replica reports (about 512K characters of cached prompt text; a few tens of KB per poll)."""

_SEP = "\x1e"  # ASCII record separator: escaped inside JSON strings, so it never occurs in a message's JSON


def routing_text(prompt: str | None, messages: list[dict] | None, tools: list[dict] | None = None,
                 cache_salt: str | None = None) -> str:
    """The canonical text a request's prefix is hashed over (see the module docstring). Exactly one
    of ``prompt`` and ``messages`` is expected; a raw prompt and a chat never share a prefix."""
    head = (cache_salt or "") + _SEP + (json.dumps(tools, sort_keys=True) if tools else "") + _SEP
    if messages is None:
        return head + "p" + _SEP + (prompt or "")
    return head + "c" + _SEP + "".join(json.dumps(m, sort_keys=True, default=str) + _SEP for m in messages)


def text_block_hashes(text: str, block_chars: int = TEXT_BLOCK_CHARS) -> list[int]:
    """Chain hashes of the full ``block_chars``-character blocks of ``text`` (see the module docstring)."""
    out, parent = [], b""
    for i in range(len(text) // block_chars):
        block = text[i * block_chars: (i + 1) * block_chars].encode("utf-8", "surrogatepass")
        parent = hashlib.blake2b(parent + block, digest_size=DIGEST_SIZE).digest()
        out.append(int.from_bytes(parent, "little"))
    return out


def cached_chars(hashes: list[int], held: Iterable[int] | None, block_chars: int = TEXT_BLOCK_CHARS) -> int:
    """Characters of the routing text whose hashes are ``hashes`` that a replica holding ``held`` has
    cached: the longest prefix whose last block's hash it holds (a chain hash stands for its whole
    prefix). 0 when ``held`` is empty or None."""
    if not held:
        return 0
    held = held if isinstance(held, (set, frozenset)) else set(held)
    for i in range(len(hashes) - 1, -1, -1):
        if hashes[i] in held:
            return (i + 1) * block_chars
    return 0


class PrefixIndex:
    """The routing-text block hashes of the prompts a replica prefilled, least recently used first.

    A prompt's hashes are added leaf first, so its first block is the most recent: trimming from the
    old end drops the tails of chains before their roots, as the engine's cache (which evicts the
    least recently released block) loses them.

    :meth:`report` gives the most recent hashes that fit the engine's cache (its cached tokens times
    the replica's characters per token): both sides evict least recently used, so the recent hashes
    approximate what the engine still holds.
    """

    def __init__(self, capacity: int = 4 * MAX_REPORTED):
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()
        self._version = 0
        self._report: tuple[int, int, frozenset[int]] = (-1, -1, frozenset())

    def add(self, hashes: list[int]) -> None:
        """A prompt with these routing-text hashes was admitted (its prompt blocks enter the cache)."""
        for h in reversed(hashes):
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)
        self._version += 1

    def __len__(self) -> int:
        return len(self._hashes)

    def report(self, cached_tokens: int, chars_per_token: float, block_chars: int = TEXT_BLOCK_CHARS) -> frozenset[int]:
        """The most recent hashes whose text fits ``cached_tokens`` tokens of cache, at most ``MAX_REPORTED``."""
        n = min(int(cached_tokens * chars_per_token // block_chars), MAX_REPORTED, len(self._hashes))
        if self._report[:2] != (self._version, n):
            recent = list(self._hashes)[len(self._hashes) - n:] if n else []
            self._report = (self._version, n, frozenset(recent))
        return self._report[2]
