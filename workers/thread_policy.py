"""How many intra-op threads each engine step runs on, learned from the step times this engine sees.

A CPU engine's threads synchronise at every linear of every layer (a step is ~200 parallel loops).
When another process takes a core, for a moment (a ``nice -n 19`` busy loop, Ray's daemons) or for
good (a load generator that keeps a core busy), the thread on that core stalls every loop until the
scheduler gives it the core back, and a step on two threads becomes slower than on one. On a quiet
machine, more threads help only where a step has enough rows to be compute-bound (batched decode,
draft trees, prompt chunks); a batch-1 decode step streams the weights at the memory system's speed
and gains little, while a second spinning thread takes the core the HTTP ingress needs.

So the number is measured, not configured: per size class of step (rows in the step, in powers of
two; each time scaled to the class's smallest row count by :attr:`ThreadPolicy.fixed_rows`), the
lower quartile of the last :attr:`ThreadPolicy.samples` step times on each candidate thread count; a
step runs on the count with the lowest, more threads winning ties within :attr:`ThreadPolicy.margin`
(a step's time does not show what its threads cost the rest of the process, and over HTTP
preferring fewer threads on ties served less at high concurrency; BENCHMARKS.md "Sharing the CPU").
Now and then a size class probes a neighbouring count for :attr:`ThreadPolicy.probe_samples` measured
steps, so the choice follows the machine as the load on it changes. The wait between probes keeps
their cost within :attr:`ThreadPolicy.probe_budget` of the class's own step time (a prompt-chunk
class that runs one step in ten is probed ten times less often than one that runs every step).
Probes of more threads come at least every :attr:`ThreadPolicy.max_probe_interval_s` (a core given
back is found within seconds); probes of fewer threads come that often only once the best count has
drifted (its estimate up by more than the margin since the last probe, or its last 3 steps at twice
that figure: a core taken), else as the budget allows, so on a quiet machine they cost nothing more.
Those quicker probes still cost at most :attr:`ThreadPolicy.fast_probe_budget` of the class's time.

After the count changes, a step of the same class is not measured (once the count has a sample)
until one step and :attr:`ThreadPolicy.warmup_s` have passed on it (a step of ten times that is
measured anyway): threads that slept wake up and find their caches cold, and in a Serve replica the
switch costs more than one short step. Measured there (2-core Xeon, batch 1, 2026-12-05): with one
unmeasured step, probes of the count not in use read 1.5-3x its steady step time (2 threads: 10-20
ms probed against 5 ms steady), so whichever count ran last stayed chosen, and a burst of slow
2-thread steps left the replica on 1 thread (time per output token 7.7-8 ms against 5.5 ms on 2).
A step whose class differs from the previous step's is measured, switch and all: a prompt chunk
between decode steps on another count pays that switch every time. (Unmeasured, a probe of such a
class never ended: with 16 concurrent requests and uncached prompts, a 2-core EPYC (Zen 4) replica
ran 55 of 62 steps of 64-127 rows on 1 thread at 1.3x their time on 2, and served 0.90x the tokens/s
of 2 threads always; BENCHMARKS.md section 21.)

Why a low quantile of a few recent steps and probes of several: a
served replica's steps have outliers that have nothing to do with their thread count, and they land
on whichever count is in use: a preemption by one of Ray's threads, and as one request ends and the
next arrives, a few steps on 2 threads at 3x while the ingress takes a core (20-65 ms against 6 ms;
1 thread, which leaves a core free, sees 1.2x). With a moving average (weight 0.25 per step) each
outlier moved the count in use by a quarter of its size, past the stale figure of the count not in
use, and a one-step probe moved that stale figure only a quarter of the way back: a 2-core EPYC
(Zen 3) replica at batch 1 ran 66% of its steps on 1 thread (median 8.2 ms) against 6.5 ms on 2
(2026-12-07, BENCHMARKS.md section 21). The lower quartile moves only when most recent steps do
(a core taken for good slows them all), and a probe's figure is all fresh. When the machine slows
for both counts, the count in use falls behind the other's older figure and the steps moved there
replace it within a few steps.

Kernels give the same bits on any thread count (tests/workers/kernels), so the choice changes only
speed, never output.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


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
    fixed_rows: a step's cost taken as proportional to ``fixed_rows + rows`` (the weights streamed
        once per step, about this many rows' compute), so that steps of different sizes in one
        class compare: each time is scaled to the class's smallest row count.
    samples: step times kept per size class and count; their lower quartile is the count's estimate
        (slow steps must fill three quarters of them to move it).
    probe_samples: the measured steps of one probe (fewer, down to one, where they would cost more
        than ``probe_budget`` of ``max_probe_interval_s``); a probe's steps replace the count's older ones.
    warmup_s: after a change of count, steps of the class that ran last are measured once one step
        and this much step time (seconds) have passed on the new count.
    probe_budget: the fraction of a size class's time that probing a slower count may cost: the wait
        before the next probe is at least what the last one cost over this (so a slow count on long
        steps is probed rarely). Probes of more threads wait at most ``max_probe_interval_s`` (a
        count that was slow under contention is found again within seconds once the machine is
        quiet); probes of fewer threads wait that little only once the best count has drifted (its
        estimate up by more than ``margin`` since the last probe, or its last 3 steps at twice that
        figure: the machine changed), else the budget's whole wait.
    fast_probe_budget: what those quicker probes may cost at most, as a fraction of the class's
        step time (a class that runs once a minute is not probed every 10 s).
    margin: more threads are kept unless fewer are at least this fraction faster.
    """

    max_threads: int
    probe_interval_s: float = 1.0
    fixed_rows: int = 64
    samples: int = 9
    probe_samples: int = 5
    warmup_s: float = 0.02
    probe_budget: float = 0.02
    fast_probe_budget: float = 0.1
    max_probe_interval_s: float = 10.0
    margin: float = 0.15
    _step_s: dict[tuple[int, int], deque] = field(default_factory=dict)  # the last `samples` step times
    _steps: dict[tuple[int, int], int] = field(default_factory=dict)  # steps run, per (class, count)
    _next_probe: dict[tuple[int, int], tuple[float, float, float, float]] = field(default_factory=dict)
    # (class, count) -> when a probe is due (see choose)
    _class_s: dict[int, float] = field(default_factory=dict)  # step time run per class (seconds)
    _ref: dict[tuple[int, int], float] = field(default_factory=dict)  # best count's estimate at the last probe
    _probing: dict[int, list[int]] = field(default_factory=dict)  # class -> [count, samples left, samples]
    _last: int | None = None  # the count of the previous step
    _last_class: int | None = None  # its size class
    _since_switch: int = 0  # steps run on _last since the count changed
    _switch_s: float = 0.0  # their step time (seconds)
    settled: bool = False  # the last choose() returned the class's measured best count, not a probe

    def __post_init__(self):
        if self.max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {self.max_threads}")
        if not 1 <= self.probe_samples <= self.samples or not 0 <= self.warmup_s < math.inf:
            raise ValueError(f"1 <= probe_samples <= samples and warmup_s finite and >= 0 are required, got "
                             f"{self.probe_samples}, {self.samples}, {self.warmup_s}")
        self.counts = candidate_counts(self.max_threads)

    def best(self, rows: int) -> int | None:
        """The measured best count for steps of ``rows`` rows, None while some count is unmeasured."""
        c = size_class(rows)
        times = [self._estimate(c, t) for t in self.counts]
        if any(s is None for s in times):
            return None
        best = min(range(len(times)), key=times.__getitem__)
        for i in reversed(range(best + 1, len(times))):  # more threads within the margin win
            if times[i] <= times[best] * (1 + self.margin):
                return self.counts[i]
        return self.counts[best]

    def _estimate(self, c: int, t: int) -> float | None:
        """The lower quartile of the class's last step times on ``t`` threads (seconds), None if none."""
        times = sorted(self._step_s.get((c, t), ()))
        return times[len(times) // 4] if times else None

    def choose(self, rows: int, now: float) -> int:
        """Threads for the next step of ``rows`` rows at time ``now`` (seconds, monotonic); sets
        :attr:`settled`: whether that count is the class's measured best (False while a count is
        measured for the first time or probed)."""
        self.settled = False
        c = size_class(rows)
        for t in reversed(self.counts):  # measure every count, most threads first
            if (c, t) not in self._step_s:
                return t
        if c in self._probing:
            return self._probing[c][0]
        best = self.best(rows)
        if len(self.counts) == 1:
            self.settled = True
            return best
        est = self._estimate(c, best)
        ref = self._ref.setdefault((c, best), est)
        recent = self._step_s[c, best]
        # the machine changed: the estimate rose by the margin, or the last 3 steps all took twice
        # the reference (a core taken: the lower quartile moves only after 7 slow steps of 9)
        drifted = est > ref * (1 + self.margin) or (len(recent) >= 3 and min(list(recent)[-3:]) > 2 * ref)
        i = self.counts.index(best)  # probe the neighbours of the best count, the larger first
        others = [self.counts[j] for j in (i + 1, i - 1) if 0 <= j < len(self.counts)]
        spent = self._class_s.get(c, 0.0)
        for probe in others:
            # When a probe is due: (class step time for the budget's wait, class step time for the
            # fast budget's wait, wall time for the capped wait, earliest wall time). Probes of more
            # threads, and of fewer once the best count drifted, wait the capped time and the fast
            # budget's; others the budget's.
            due_s, due_fast_s, due_wall, earliest = self._next_probe.setdefault(
                (c, probe), (spent, spent, *(now + self.probe_interval_s,) * 2))
            fast = probe > best or drifted
            if (now >= due_wall and spent >= due_fast_s) if fast else (spent >= due_s and now >= earliest):
                break
        else:
            self.settled = True
            return best
        self._ref[c, best] = est
        # A probe runs until its n-th measured step, its first once its warm-up has passed (one step
        # and warmup_s); its expected cost decides the wait till the next. It measures probe_samples
        # steps, fewer where the slower count's extra time over them would exceed the budget of the
        # longest wait (long steps: prompt chunks on a count that is slower). Fewer threads within
        # the margin are taken to cost the margin (what their step time does not show).
        sp = self._estimate(c, probe)
        over = max(sp - est, self.margin * est if probe < best else 0.0)
        n = self.probe_samples if over == 0 else max(1, min(self.probe_samples, int(
            self.probe_budget * self.max_probe_interval_s / over)))
        probe_s = max(self.warmup_s, sp) + (n + 1) * sp
        wait_s = probe_s * over / sp / self.probe_budget  # of the class's step time
        self._next_probe[c, probe] = (
            spent + wait_s, spent + wait_s * self.probe_budget / self.fast_probe_budget,
            now + probe_s + min(max(self.probe_interval_s, wait_s), self.max_probe_interval_s),
            now + self.probe_interval_s)
        self._probing[c] = [probe, n, n]
        return probe

    def observe(self, rows: int, threads: int, step_s: float) -> None:
        """Record that a step of ``rows`` rows on ``threads`` threads took ``step_s`` seconds (not
        counted while the count is warming up after a change, see the module docstring)."""
        c = size_class(rows)
        if threads != self._last:
            self._since_switch, self._switch_s = 0, 0.0
        # A step ten warm-ups long outweighs the switch's cost and is measured anyway. A step whose
        # class differs from the previous step's pays the switch every time it runs between steps of
        # other classes on another count (a prompt chunk among decode steps): measured too, switch
        # and all (a probe of such a class measured nothing and ran on the probed count until its
        # bound of 1,000 steps: 2-core EPYC Zen 4 served, 16 concurrent prompts uncached, 2026-12-07).
        # Every step after the warm-up is measured, so a probe ends after its warm-up and samples.
        switched = step_s < 10 * self.warmup_s and c == self._last_class and (
            self._since_switch < 1 or self._switch_s < self.warmup_s)
        self._last, self._last_class = threads, c
        self._since_switch += 1
        if math.isfinite(step_s) and step_s > 0:
            self._switch_s += step_s
        if threads not in self.counts or not math.isfinite(step_s) or step_s <= 0:
            self._probing.pop(c, None)  # a probe ends without its samples rather than run on
            return
        key = (c, threads)
        self._steps[key] = self._steps.get(key, 0) + 1
        self._class_s[c] = self._class_s.get(c, 0.0) + step_s
        lo = 1 << (key[0] - 1)  # the class's smallest row count
        step_s *= (self.fixed_rows + lo) / (self.fixed_rows + max(rows, 1))
        times = self._step_s.get(key)
        if switched and times:  # a cold step; the first sample of a count is taken anyway,
            return  # or a class that always follows another count's steps would never be measured
        probing = self._probing.get(key[0])
        # the probe's first measured step: the count's estimate is the probe's alone. A deque is
        # put in place already holding its sample (stats() may read it from another thread)
        if times is None or (probing and probing[0] == threads and probing[1] == probing[2]):
            self._step_s[key] = deque([step_s], maxlen=self.samples)
        else:
            times.append(step_s)
        if probing and probing[0] == threads:  # one more of the probe's samples
            probing[1] -= 1
            if probing[1] <= 0:
                del self._probing[key[0]]

    def stats(self) -> dict[str, dict[int, dict[str, float]]]:
        """``{"rows<2^c": {threads: {"ms": step ms (lower quartile of the recent steps, scaled to the
        class's smallest row count), "steps": steps run}}}`` for ``/health`` and tests. Safe to call from another thread than the engine's (a
        snapshot taken while a step is recorded is retried)."""
        for _ in range(10):
            try:
                keys = sorted(list(self._step_s))
                out: dict[str, dict[int, dict[str, float]]] = {}
                for (c, t) in keys:
                    out.setdefault(f"rows<{2 ** c}", {})[t] = {
                        "ms": round(self._estimate(c, t) * 1e3, 3), "steps": self._steps.get((c, t), 0)}
                return out
            except RuntimeError:  # the engine thread changed a dict or deque while we read it
                continue
        return {}
