"""What a replica reports about itself: routing stats (for the request router) and autoscaling stats.

Ray Serve polls a deployment's ``record_routing_stats()`` (every
``request_routing_stats_period_s``) and pushes ``record_autoscaling_stats()`` to the controller;
both return plain dicts of numbers built here from the engine's snapshot, so the router and the
autoscaling policy stay plain functions of measured state.

Keys (all numbers; times in seconds):

- ``running``, ``waiting``: requests decoding / queued in the engine; ``load``: requests the
  replica holds (admitted by Serve, tokenizing, running or waiting).
- ``free_kv_blocks``, ``num_kv_blocks``, ``tokens_per_block``, ``kv_usage`` (0-1).
- ``max_batch_size``: the engine's in-flight batch limit.
- ``step_s``: recent mean seconds per generation-only engine iteration (exponential moving average;
  iterations that prefill a prompt chunk are left out), 0 before any.
- ``tau``: live tokens per step of the speculation in use (a moving average over drafted steps);
  None before the first drafted step or without a drafter.
- ``shape``: the draft-tree shape in use, ``"BxD"``, or ``"plain"``.
- ``ttft_p90_s``: 90th percentile time to first token over the last ``window_s`` seconds (None when
  no request started in it).
- ``prefix_hashes``: routing-text block hashes of the prompts the replica's prefix cache likely still
  holds, each with the prompt tokens up to its block's end (a dict of ints, :mod:`workers.text_prefix`;
  empty with prefix caching off); ``prefill_s_per_token``: seconds per prompt position of iterations
  that prefill (moving average; 0 before any). Not numbers the autoscaler reads: ``prefix_hashes`` is
  left out of the autoscaling stats.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from workers.text_prefix import PrefixIndex, text_block_hashes

if TYPE_CHECKING:
    from workers.engine import EngineSnapshot


class TtftWindow:
    """Times to first token of the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 30.0):
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, ttft_s: float, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, ttft_s))

    def p90(self, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        if not self._samples:
            return None
        return float(np.percentile([t for _, t in self._samples], 90))


class PrefixStats:
    """A replica's side of cache-aware routing: the routing-text hashes of the prompts it admitted
    (:class:`~workers.text_prefix.PrefixIndex`) and its engine's seconds per prefilled position (set
    by the replica)."""

    def __init__(self):
        self.index = PrefixIndex()
        self.prefill_s_per_token = 0.0

    def admitted(self, text: str, prompt_tokens: int) -> None:
        """A request with routing text ``text`` (:func:`~workers.text_prefix.routing_text`) and
        ``prompt_tokens`` prompt tokens was admitted."""
        self.index.add(text_block_hashes(text), prompt_tokens, len(text))


def engine_stats(snapshot: EngineSnapshot, load: int, step_s: float, ttft_p90_s: float | None,
                 max_batch_size: int, speculative_available: bool, prefix: PrefixStats | None = None) -> dict:
    """The stats dict (see the module docstring) from an engine's ``snapshot()`` and the replica's
    own numbers; ``max_batch_size`` and ``speculative_available`` are the engine's; ``prefix`` the
    replica's prefix-cache figures (None: prefix caching off)."""
    policy_stats = snapshot.spec_stats
    tau = policy_stats.get("tau") if speculative_available else None
    return {
        "load": load,
        "running": snapshot.running,
        "waiting": snapshot.waiting,
        "free_kv_blocks": snapshot.free_blocks,
        "num_kv_blocks": snapshot.num_blocks,
        "tokens_per_block": snapshot.kv_size.block_size,
        "kv_usage": snapshot.kv_usage,
        "max_batch_size": max_batch_size,
        "step_s": step_s,
        "tau": float(tau) if tau else None,
        "shape": policy_stats.get("shape") or "plain",
        "ttft_p90_s": ttft_p90_s,
        "prefix_hashes": prefix.index.report(snapshot.cached_blocks * snapshot.kv_size.block_size) if prefix else {},
        "prefill_s_per_token": prefix.prefill_s_per_token if prefix else 0.0,
    }
