"""How many intra-op threads each engine step runs on, learned from the step times this engine sees.

A CPU engine's threads synchronise at every linear of every layer (a step is ~200 parallel loops).
When another process takes a core, for a moment (a ``nice -n 19`` busy loop, Ray's daemons) or for
good (a load generator that keeps a core busy), the thread on that core stalls every loop until the
scheduler gives it the core back, and a step on two threads becomes slower than on one. On a quiet
machine, more threads help only where a step has enough rows to be compute-bound (batched decode,
draft trees, prompt chunks); a batch-1 decode step streams the weights at the memory system's speed
and gains little, while a second spinning thread takes the core the HTTP ingress needs.

So the number is measured, not configured: per size class of step (rows in the step, in powers of
two), a moving average of the step time on each candidate thread count; a step runs on the count
with the lowest average, more threads winning ties within :attr:`ThreadPolicy.margin` (a step's
time does not show what its threads cost the rest of the process, and over HTTP preferring fewer
threads on ties served less at high concurrency; BENCHMARKS.md "Sharing the CPU"). Now and then :attr:`ThreadPolicy.probe_steps` steps of a size class try a neighbouring count, so
the choice follows the machine as the load on it changes; the wait between probes keeps their cost
within :attr:`ThreadPolicy.probe_budget` of the class's time (at most
:attr:`ThreadPolicy.max_probe_interval_s`). After the count changes, steps are not measured (once the
count has a sample) until one step and :attr:`ThreadPolicy.warmup_s` have passed on it (a step of
ten times that is measured anyway), and a probe
lasts until it has one measured step: threads that slept
wake up and find their caches cold, and in a Serve replica the switch costs more than one short step. Measured there
(2-core Xeon, batch 1, 2026-12-05): with one unmeasured step, probes of the count not in use read
1.5-3x its steady step time (2 threads: 10-20 ms probed against 5 ms steady), so whichever count
ran last stayed chosen, and a burst of slow 2-thread steps left the replica on 1 thread (time per
output token 7.7-8 ms against 5.5 ms on 2).

Kernels give the same bits on any thread count (tests/workers/kernels), so the choice changes only
speed, never output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


MAX_PROBE_STEPS = 1000
"""A safety bound on one probe's steps; a probe ends at its first measured step, one step and
``warmup_s`` after it starts."""


def candidate_counts(max_threads: int) -> list[int]:
    """Thread counts worth trying: 1, powers of two below ``max_threads``, and ``max_threads``."""
    counts = {1, max_threads}
    t = 2
    while t < max_threads:
        counts.add(t)
        t *= 2
    return sorted(counts)


def size_class(rows: int) -> int:
    """Steps of ``rows`` query rows (decode rows + draft-tree rows + prompt tokens) in classes of
    powers of two: 1, 2-3, 4-7, ..."""
    return max(rows, 1).bit_length()


@dataclass
class ThreadPolicy:
    """Chooses the thread count of each step from measured step times (see the module docstring).

    max_threads: the most threads a step may run on (the engine's ``num_threads``).
    probe_interval_s: shortest wait (seconds of wall time) between two probes of one size class; a
        probe tries a neighbour of the best count (the next larger first, then the next smaller).
    probe_steps: steps of one probe as its cost is estimated (at least; a probe runs until its
        first measured step, so longer where steps are short against ``warmup_s``).
    warmup_s: after a change of count, steps are measured once one step and this much step time
        (seconds) have passed on the new count.
    probe_budget: the fraction of a size class's time that probing a slower count may cost: the wait
        before the next probe is at least what the last one cost over this (so a slow count on long
        steps is probed rarely), at most ``max_probe_interval_s`` (so a count that was slow under
        contention is found again within seconds once the machine is quiet).
    alpha: weight of the newest step time in each moving average.
    margin: more threads are kept unless fewer are at least this fraction faster.
    """

    max_threads: int
    probe_interval_s: float = 1.0
    probe_steps: int = 6
    warmup_s: float = 0.02
    probe_budget: float = 0.02
    max_probe_interval_s: float = 10.0
    alpha: float = 0.25
    margin: float = 0.15
    _step_s: dict[tuple[int, int], float] = field(default_factory=dict)
    _next_probe: dict[int, float] = field(default_factory=dict)
    _probe_turn: dict[int, int] = field(default_factory=dict)
    _probing: dict[int, tuple[int, int]] = field(default_factory=dict)  # class -> (count, steps left)
    _last: int | None = None  # the count of the previous step
    _since_switch: int = 0  # steps run on _last since the count changed
    _switch_s: float = 0.0  # their step time (seconds)

    def __post_init__(self):
        if self.max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {self.max_threads}")
        if self.probe_steps < 2 or not 0 <= self.warmup_s < math.inf:
            raise ValueError(f"probe_steps must be >= 2 and warmup_s finite and >= 0, got {self.probe_steps}, "
                             f"{self.warmup_s}")
        self.counts = candidate_counts(self.max_threads)

    def best(self, rows: int) -> int | None:
        """The measured best count for steps of ``rows`` rows, None while some count is unmeasured."""
        c = size_class(rows)
        times = [self._step_s.get((c, t)) for t in self.counts]
        if any(s is None for s in times):
            return None
        best = min(range(len(times)), key=times.__getitem__)
        for i in reversed(range(best + 1, len(times))):  # more threads within the margin win
            if times[i] <= times[best] * (1 + self.margin):
                return self.counts[i]
        return self.counts[best]

    def choose(self, rows: int, now: float) -> int:
        """Threads for the next step of ``rows`` rows at time ``now`` (seconds, monotonic)."""
        c = size_class(rows)
        for t in reversed(self.counts):  # measure every count, most threads first
            if (c, t) not in self._step_s:
                return t
        if c in self._probing:
            probe, left = self._probing[c]
            if left > 1:
                self._probing[c] = (probe, left - 1)
            else:
                del self._probing[c]
            return probe
        best = self.best(rows)
        if now < self._next_probe.setdefault(c, now + self.probe_interval_s) or len(self.counts) == 1:
            return best
        i = self.counts.index(best)  # probe the neighbours of the best count, the larger first
        others = [self.counts[j] for j in (i + 1, i - 1) if 0 <= j < len(self.counts)]
        turn = self._probe_turn.get(c, 0) % len(others)
        self._probe_turn[c] = turn + 1
        probe = others[turn]
        # a probe runs until its first measured step, which comes once its warm-up has passed (on
        # short steps, more than probe_steps steps); its expected cost decides the wait till the next
        sp, sb = self._step_s[c, probe], self._step_s[c, best]
        probe_s = max(self.probe_steps * sp, self.warmup_s + 2 * sp)
        extra_s = probe_s * max(sp - sb, 0.0) / sp
        wait_s = min(max(self.probe_interval_s, extra_s / self.probe_budget), self.max_probe_interval_s)
        self._next_probe[c] = now + wait_s
        self._probing[c] = (probe, MAX_PROBE_STEPS - 1)
        return probe

    def observe(self, rows: int, threads: int, step_s: float) -> None:
        """Record that a step of ``rows`` rows on ``threads`` threads took ``step_s`` seconds (not
        counted while the count is warming up after a change, see the module docstring)."""
        if threads != self._last:
            self._since_switch, self._switch_s = 0, 0.0
        # a step ten warm-ups long outweighs the switch's cost and is measured anyway (a prompt chunk
        # between decode steps on another count would otherwise never be)
        switched = step_s < 10 * self.warmup_s and (self._since_switch < 1 or self._switch_s < self.warmup_s)
        self._last = threads
        self._since_switch += 1
        if math.isfinite(step_s) and step_s > 0:
            self._switch_s += step_s
        if threads not in self.counts or not math.isfinite(step_s) or step_s <= 0:
            return
        key = (size_class(rows), threads)
        old = self._step_s.get(key)
        if switched and old is not None:  # a cold step; the first sample of a count is taken anyway,
            return  # or a class that always follows another count's steps would never be measured
        self._step_s[key] = step_s if old is None else (1 - self.alpha) * old + self.alpha * step_s
        if self._probing.get(key[0], (None,))[0] == threads:  # the probe has its sample
            del self._probing[key[0]]

    def stats(self) -> dict[str, dict[int, float]]:
        """``{"rows<2^c": {threads: mean step ms}}`` for logs and tests."""
        out: dict[str, dict[int, float]] = {}
        for (c, t), s in sorted(self._step_s.items()):
            out.setdefault(f"rows<{2 ** c}", {})[t] = round(s * 1e3, 3)
        return out
