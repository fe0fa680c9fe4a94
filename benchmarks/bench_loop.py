"""A closed loop on an engine in process: ``concurrency`` requests in flight, the next one added as one
finishes (what a fixed number of clients, each sending its next request on an answer, puts on a
replica). Shared by ``auto_vs_fixed.py``, ``served_vs_engine.py`` and ``mixed_iterations.py``; each
adds its requests its own way (prompt, sampling parameters, engine mode) through ``add``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class LoopRun:
    """What one closed loop decoded.

    outputs: each request's output token ids, by the index it was added with (0 .. num_requests - 1).
    completion_tokens: completion tokens of every request, as the engine's final deltas count them.
    wall_s: seconds from the first request added to the last one finished.
    ttft_s: seconds from a request's ``add`` to its first delta carrying tokens, by index (a request
        that produced no token has none).
    """

    outputs: list[list[int]]
    completion_tokens: int
    wall_s: float
    ttft_s: dict[int, float]

    @property
    def tokens_per_s(self) -> float:
        """Completion tokens per wall-clock second of the loop."""
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


def closed_loop(engine, num_requests: int, concurrency: int, add: Callable[[str, int, int], None],
                prefix: str = "r") -> LoopRun:
    """Run ``num_requests`` requests on ``engine`` (anything with ``step()`` returning deltas that carry
    ``request_id``, ``token_ids``, ``finished`` and ``completion_tokens``), at most ``concurrency`` in
    flight. ``add(request_id, index, in_flight)`` adds request ``index`` under ``request_id``
    (``prefix`` + index) with ``in_flight`` requests held counting it (what a replica's load is then).

    Raises:
        ValueError: ``num_requests < 0`` or ``concurrency < 1``.
    """
    if num_requests < 0 or concurrency < 1:
        raise ValueError(f"need num_requests >= 0 and concurrency >= 1, got {num_requests} and {concurrency}")
    outputs: list[list[int]] = [[] for _ in range(num_requests)]
    index: dict[str, int] = {}
    started: dict[int, float] = {}
    ttft: dict[int, float] = {}
    issued = done = tokens = 0
    t0 = time.perf_counter()
    while done < num_requests:
        while issued < num_requests and issued - done < concurrency:
            rid = f"{prefix}{issued}"
            index[rid] = issued
            started[issued] = time.perf_counter()
            add(rid, issued, issued - done + 1)
            issued += 1
        for d in engine.step():
            i = index[d.request_id]
            if d.token_ids and i not in ttft:
                ttft[i] = time.perf_counter() - started[i]
            outputs[i] += d.token_ids
            if d.finished:
                done += 1
                tokens += d.completion_tokens
    return LoopRun(outputs, tokens, time.perf_counter() - t0, ttft)
