"""Step times learned from the replica's own iterations, over a seed table.

The goodput model (:mod:`workers.speculation.goodput`) needs ``t_plain(b)`` and ``t_spec(b, s)``:
seconds per generation step at batch ``b``, plain or with draft-tree shape ``s``. A table measured
elsewhere (another CPU, older code) can be several times off, so :class:`LiveStepCosts` corrects its
seed with what the engine measures on every generation-only iteration:

    t(b, c) = seed_t(b, c) * ratio(bucket(b), c)

for each choice ``c`` (plain, or a shape), where ``ratio`` is the moving median of ``measured /
seed_t`` over the last ``window`` clean samples of that (batch-size bucket, choice). A bucket without
samples borrows the nearest sampled bucket's ratio of the same choice (a kernel that got 3x faster is
3x faster at every batch size); a choice never sampled keeps its seed (nothing says how wrong it
is: :class:`workers.speculation.controller.SpecController` probes it). The seed's shape in ``b``
interpolates within a bucket; the live figures set the level. A median, not a mean: one iteration
slowed by another process on the core moves nothing. Samples older than ``max_age`` samples of the
replica leave a window when the window is next sampled: a choice timed only while the replica warmed
up (cold caches, first matmul shapes) or while another process held a core is re-timed by an
exploration probe (:mod:`workers.speculation.exploration`, every choice whose newest sample is older
than the controller's ``explore_refresh``) and then judged by the new samples alone.

A step's cost also grows with the context the batch's requests attend over (on the AMX Xeon a 2x2
tree step takes ~9.8 ms more per 1,000 context tokens, a plain step ~3.4 ms; BENCHMARKS.md 14), so
a window mixing long and short requests prices neither. Each sample keeps the mean context of its
iteration; where a window's samples span enough context (:data:`MIN_CONTEXT_SPREAD`), ``ratio`` is a
robust line in the context (Theil-Sen: the median of the pairwise slopes, never negative, through
the median intercept) read at the iteration's context (:meth:`LiveStepCosts.at_context`; held within
half to twice the contexts sampled), else the median as before.

Buckets are powers of two: 1, 2, 3-4, 5-8, 9-16, ...
"""

from __future__ import annotations

import statistics
from collections import deque

from workers.speculation.goodput import Shape, StepCosts

Choice = Shape | None  # None: plain decoding

MIN_CONTEXT_SPREAD = 128  # context tokens between a window's extremes before it fits a line in the context
MIN_PAIR_GAP = 32  # context tokens two samples must differ by for their slope to count


def context_line(samples: list[tuple[float, float]]) -> tuple[float, float] | None:
    """``(intercept, slope)`` of ``ratio = intercept + slope * context`` through ``samples`` of
    ``(context, ratio)``: Theil-Sen (the median of the slopes of pairs at least :data:`MIN_PAIR_GAP`
    tokens apart, clamped at 0: more context never makes a step cheaper; the intercept the median of
    ``ratio - slope * context``), robust to a few slow iterations. None when the contexts span less
    than :data:`MIN_CONTEXT_SPREAD` tokens or no pair is far enough apart (the caller takes the median)."""
    contexts = [c for c, _ in samples]
    if len(samples) < 3 or max(contexts) - min(contexts) < MIN_CONTEXT_SPREAD:
        return None
    slopes = [(r1 - r0) / (c1 - c0) for i, (c0, r0) in enumerate(samples) for c1, r1 in samples[i + 1:]
              if abs(c1 - c0) >= MIN_PAIR_GAP]
    if not slopes:
        return None
    slope = max(0.0, statistics.median(slopes))
    return statistics.median(r - slope * c for c, r in samples), slope


def batch_bucket(b: int) -> int:
    """The bucket of batch size ``b``: the smallest power of two >= ``b`` (1, 2, 4, 8, ...).

    Raises:
        ValueError: ``b < 1``.
    """
    if b < 1:
        raise ValueError(f"batch size must be >= 1, got {b}")
    return 1 << (b - 1).bit_length()


class LiveStepCosts:
    """Seed step costs corrected by live samples; the same reading interface as
    :class:`~workers.speculation.goodput.StepCosts` (``shapes``, ``tokens_per_step``, ``t_plain``,
    ``t_spec``), so the goodput functions take either. Engine thread only (not thread-safe).

    seed: the table the estimates start from (a calibration file, or the start-up measurement).
    window: samples per (bucket, choice) the moving median (or line in the context) runs over.
    max_age: a sample older than this many samples (of any bucket and choice) leaves its window the
        next time that window is sampled; None: only ``window`` limits it.

    Raises:
        ValueError: ``window < 1`` or ``max_age < 1``.
    """

    def __init__(self, seed: StepCosts, window: int = 16, max_age: int | None = None):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if max_age is not None and max_age < 1:
            raise ValueError(f"max_age must be >= 1, got {max_age}")
        self.seed = seed
        self.window = window
        self.max_age = max_age
        self._now = 0  # samples observed so far (the clock ages are counted in)
        # (when, context tokens or None, measured / seed)
        self._samples: dict[tuple[int, Choice], deque[tuple[int, float | None, float]]] = {}
        self._ratio: dict[tuple[int, Choice], float] = {}  # the window's median
        # the window's line in the context: intercept, slope, and the contexts it is read within
        self._line: dict[tuple[int, Choice], tuple[float, float, float, float]] = {}
        self.context: float | None = None  # the context estimates are read at (at_context); None: medians

    def at_context(self, context: float | None) -> None:
        """Read estimates at ``context`` (mean context tokens per request of the iteration about to
        be planned) from now on; None: every window's median, whatever the context."""
        self.context = context

    @property
    def shapes(self) -> list[Shape]:
        return self.seed.shapes

    @property
    def tokens_per_step(self) -> dict[Shape, float]:
        return self.seed.tokens_per_step

    def seed_t(self, b: float, choice: Choice) -> float:
        """The seed's seconds per step at ``b`` for ``choice``."""
        return self.seed.t_plain(b) if choice is None else self.seed.t_spec(b, choice)

    def t(self, b: float, choice: Choice) -> float:
        """Estimated seconds per step at ``b`` for ``choice`` (None: plain)."""
        return self.seed_t(b, choice) * self.ratio(max(1, round(b)), choice)

    def t_plain(self, b: float) -> float:
        return self.t(b, None)

    def t_spec(self, b: float, shape: Shape) -> float:
        return self.t(b, shape)

    def ratio(self, b: int, choice: Choice) -> float:
        """measured / seed at ``b``'s bucket for ``choice`` (at :attr:`context`, where its window fits
        a line in the context): its own samples, else the nearest sampled bucket's (the smaller on a
        tie), else 1.0 (never sampled)."""
        bucket = batch_bucket(b)
        if (bucket, choice) not in self._ratio:
            sampled = [k for k, c in self._ratio if c == choice]
            if not sampled:
                return 1.0
            bucket = min(sampled, key=lambda k: (abs(k.bit_length() - batch_bucket(b).bit_length()), k))
        line = self._line.get((bucket, choice))
        if line is None or self.context is None:
            return self._ratio[bucket, choice]
        intercept, slope, lo, hi = line  # read within half to twice the contexts sampled
        return max(intercept + slope * min(max(self.context, lo), hi), 1e-3)

    def probe_t(self, b: float, choice: Choice) -> float:
        """What a step of ``choice`` at ``b`` is expected to cost when probed: :meth:`t`, but a choice
        never sampled takes the median ratio of all that were (a seed several times off for one choice
        likely is for the others; :meth:`t` does not assume it, since it decides between them)."""
        if any(c == choice for _, c in self._ratio) or not self._ratio:
            return self.t(b, choice)
        return self.seed_t(b, choice) * statistics.median(self._ratio.values())

    def samples(self, b: int, choice: Choice) -> int:
        """Live samples held for ``b``'s bucket and ``choice`` (at most ``window``)."""
        return len(self._samples.get((batch_bucket(b), choice), ()))

    def age(self, b: int, choice: Choice) -> int | None:
        """Samples observed since the newest one of ``b``'s bucket and ``choice`` (None: never sampled)."""
        window = self._samples.get((batch_bucket(b), choice))
        return self._now - window[-1][0] if window else None

    def observe(self, b: int, choice: Choice, seconds: float, context: float | None = None) -> None:
        """One clean generation-only iteration: ``b`` requests, all plain (``choice`` None) or all
        drafting with ``choice``, took ``seconds``; ``context``: its mean context tokens per request
        (None: unknown; a window holding such a sample keeps its median).

        Raises:
            ValueError: ``b < 1``, ``seconds`` not > 0, or a shape the seed does not time.
        """
        if not seconds > 0:
            raise ValueError(f"step seconds must be > 0, got {seconds}")
        if choice is not None and choice not in self.seed.spec_s:
            raise ValueError(f"shape {choice} is not in the step-cost table")
        key = (batch_bucket(b), choice)
        self._now += 1
        window = self._samples.setdefault(key, deque(maxlen=self.window))
        window.append((self._now, context, seconds / self.seed_t(b, choice)))
        while self.max_age is not None and self._now - window[0][0] > self.max_age:
            window.popleft()  # never the sample just added
        self._ratio[key] = statistics.median(r for _, _, r in window)
        line = None if any(c is None for _, c, _ in window) else context_line([(c, r) for _, c, r in window])
        if line is None:
            self._line.pop(key, None)
        else:
            contexts = [c for _, c, _ in window]
            self._line[key] = (*line, min(contexts) / 2, max(contexts) * 2)

    def reseed(self, seed: StepCosts) -> None:
        """Start over from ``seed`` (a fresh measurement): live samples so far are dropped, since their
        ratios were taken against the old seed."""
        self.seed = seed
        self._samples.clear()
        self._ratio.clear()
        self._line.clear()
