"""What the engine counts for metrics: tokens, steps, drafts, preemptions and timings.

The engine only counts (vLLM V1 splits it the same way: the engine core produces stats, a logger
turns them into Prometheus series); ``cluster.observability`` records them through Ray's metrics
API. :class:`EngineStats` accumulates between two :meth:`EngineStats.drain` calls; it is owned by
the engine thread (``drain`` runs there too, see ``AsyncEngine.call``), so it needs no lock.

Counts follow what a request *emits*: tokens cut by EOS, a stop string or ``max_tokens`` inside an
accepted block are not counted, so ``generation_tokens`` sums to the responses'
``usage.completion_tokens`` and ``accepted_tokens`` to their ``accepted_draft_tokens``.

Speculative decoding, in vLLM V1's terms (``vllm/v1/spec_decode/metrics.py``): a *draft* is one
request's draft tree in one step; its *draft tokens* are the tree's depth (``draft_len_per_beam``,
or fewer near ``max_tokens``): the most tokens the step could accept, as vLLM's k; *accepted tokens*
are drafted tokens the base model accepted and the request emitted; ``accepted_per_pos[i]`` counts
drafts whose accepted path reached depth ``i + 1``. ``generation_steps`` counts every
generation-phase step of every request, drafting or plain, so ``(accepted + steps) / steps`` is the
responses' ``tokens_per_step`` and ``1 + accepted / drafts`` vLLM's mean acceptance length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

ITERATION_KINDS = ("context", "plain", "spec", "mixed")
"""``context``: context chunks only; ``plain``/``spec``: generation steps only, without or with a
draft tree; ``mixed``: context chunks and generation steps in one forward."""


@dataclass
class RequestTiming:
    """One request's engine phases, seconds: ``queue_s`` (added -> first scheduled), ``prefill_s``
    (first scheduled -> first token), ``decode_s`` (first -> last token; set when it finishes)."""

    queue_s: float
    prefill_s: float
    decode_s: float | None = None


@dataclass
class EngineStatsDelta:
    """Counts since the previous drain, plus the engine's state now.

    Counters (ints, >= 0): ``prompt_tokens`` (each request's prompt once, at its first token),
    ``generation_tokens``, ``generation_steps``, ``num_preemptions``, ``aborted`` (unfinished
    requests aborted), ``drafts``, ``draft_tokens``,
    ``accepted_tokens``, ``accepted_per_pos`` (index = draft position), ``grammar_rejected_tokens``
    (draft tokens not accepted because a grammar forbade the next drafted token),
    ``prefix_cache_queries`` / ``prefix_cache_hits`` (prompt tokens looked up in the prefix cache at
    admission / found there; vLLM's counters). Samples: ``iterations``
    ``[(kind, seconds)]``, ``first_tokens`` (timings of requests that got their first token) and
    ``finished`` (timings of requests that finished, with ``decode_s``). State: ``num_running``,
    ``num_waiting`` (requests), ``kv_cache_usage`` (0-1, used blocks / blocks) and ``spec_shape``
    ``(num_beams, draft_len_per_beam)`` of the last iteration, ``(0, 0)`` when it decoded plain.
    """

    prompt_tokens: int = 0
    generation_tokens: int = 0
    generation_steps: int = 0
    num_preemptions: int = 0
    aborted: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    grammar_rejected_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    iterations: list[tuple[str, float]] = field(default_factory=list)
    first_tokens: list[RequestTiming] = field(default_factory=list)
    finished: list[RequestTiming] = field(default_factory=list)
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    spec_shape: tuple[int, int] = (0, 0)


class EngineStats:
    """Accumulates one engine's counts; the engine calls the ``on_*`` methods from :meth:`Engine.step`."""

    def __init__(self):
        self._delta = EngineStatsDelta()
        self._times: dict[str, list[float]] = {}  # request id -> [added, scheduled, first token]
        self._shape = (0, 0)

    def on_added(self, request_id: str) -> None:
        self._times[request_id] = [time.perf_counter()]

    def on_scheduled(self, request_id: str, now: float) -> None:
        times = self._times.get(request_id)
        if times is not None and len(times) == 1:
            times.append(now)

    def on_tokens(self, request_id: str, prompt_len: int, before: int, after: int, finished: bool) -> None:
        """A request emitted ``after - before`` tokens this step (``before`` 0: its first tokens)."""
        d, now = self._delta, time.perf_counter()
        d.generation_tokens += after - before
        times = self._times.get(request_id)
        if before == 0 and after > 0:
            d.prompt_tokens += prompt_len
            if times is not None and len(times) == 2:
                times.append(now)
                d.first_tokens.append(RequestTiming(times[1] - times[0], now - times[1]))
        if finished:
            self._times.pop(request_id, None)
            if times is not None and len(times) == 3:
                d.finished.append(RequestTiming(times[1] - times[0], times[2] - times[1], now - times[2]))

    def on_prefix_cache(self, queried: int, hit: int) -> None:
        """A request's first admission looked ``queried`` prompt tokens up and found ``hit`` cached."""
        self._delta.prefix_cache_queries += queried
        self._delta.prefix_cache_hits += hit

    def on_generation_step(self, draft_len: int, accepted: int, grammar_rejected: bool = False) -> None:
        """One request's generation step: ``draft_len`` the tree's depth (0 = plain step),
        ``accepted`` the drafted tokens it emitted (``<= draft_len``); ``grammar_rejected``: the
        request's grammar, not the base model, forbade every drafted token after the accepted path,
        so the ``draft_len - accepted`` rejected tokens count as grammar-rejected."""
        d = self._delta
        d.generation_steps += 1
        if draft_len <= 0:
            return
        d.drafts += 1
        d.draft_tokens += draft_len
        d.accepted_tokens += accepted
        if grammar_rejected:
            d.grammar_rejected_tokens += draft_len - accepted
        if len(d.accepted_per_pos) < draft_len:
            d.accepted_per_pos.extend([0] * (draft_len - len(d.accepted_per_pos)))
        for pos in range(accepted):
            d.accepted_per_pos[pos] += 1

    def on_iteration(self, num_context: int, num_generation: int, spec_shape, num_preempted: int,
                     seconds: float) -> None:
        d = self._delta
        d.num_preemptions += num_preempted
        if num_generation == 0:
            kind = "context"
        else:
            kind = "mixed" if num_context else ("spec" if spec_shape else "plain")
        if num_generation:
            self._shape = tuple(spec_shape) if spec_shape else (0, 0)
        d.iterations.append((kind, seconds))

    def on_aborted(self, request_id: str) -> None:
        if self._times.pop(request_id, None) is not None:
            self._delta.aborted += 1

    def drain(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> EngineStatsDelta:
        """Return the counts since the previous drain (and the given state); start new ones."""
        out, self._delta = self._delta, EngineStatsDelta()
        out.num_running, out.num_waiting, out.kv_cache_usage = num_running, num_waiting, kv_cache_usage
        out.spec_shape = self._shape
        return out
