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

A step's cost also grows with the context the batch's requests attend over, so a window mixing
long and short requests prices neither, and a window sampled only at long context misprices short
ones. Each sample keeps the mean context of its iteration, and the context enters two ways:

- A window whose samples span :data:`MIN_CONTEXT_SPREAD` tokens, with :data:`MIN_END_SAMPLES` in each
  half of the span, fits its own line in the context (Theil-Sen: the median of the pairwise slopes,
  never negative, through the median intercept), read at the iteration's context
  (:meth:`LiveStepCosts.at_context`) held within the contexts it sampled. This prices a choice whose
  cost grows with context faster than another's.
- Any other window is read through one relative slope shared by every window,
  ``ratio = level * (1 + k * context)`` (:func:`relative_slope`, refitted every
  :data:`REFIT_EVERY` samples; 0 until :data:`MIN_SLOPE_PAIRS` pairs): its level is the median of
  its samples brought to no context, read at the iteration's context. The slope is fitted on a
  longer history than the windows (a window of 16 batch-1 steps spans 16 tokens of one request): per
  (bucket, choice), the newest :data:`BIN_SAMPLES` samples of each :data:`CONTEXT_BIN`-token range of
  context (none older than :data:`HISTORY_AGE` samples), each range summarized by its medians, pairs
  taken between nearby ranges of one (bucket, choice). Measured on the AMX Xeon with the broad dev
  prompts at batch 1, the relative growth is nearly the same for plain steps and 1x2 trees (0.6-0.8 per 1,000 tokens: plain 4.1 -> 5.4 ms,
  a 3-row tree 7.4 -> 9.7 ms, a 7-row tree 9.6 -> 13.5 ms from 150 to 650 tokens), so plain
  traffic at every context teaches how a tree timed only at 550 tokens costs at 100.

One tree step timed at 480 tokens among fifteen at 170-190 once made a window's own line that priced
a 1x2 step at 480+ tokens 2.5x its cost (a tree's step also varies with the rows its prompt-lookup
beam adds, which one sample cannot tell from context): hence the samples required at each end.

A window read far from every context it sampled, before the shared slope is fitted, says nothing
about the price there: traffic alternating between 100 and 1,500 tokens of context (nothing in
between: the shared slope needs ranges of context to pair) filled a 1x2 tree's window at 1,500
tokens, and read at 100 it priced the tree at 2.5x its cost there, for good (plain stayed ahead, and
nothing sampled the tree again). :meth:`LiveStepCosts.covers_context` tells the exploration probes
(:func:`workers.speculation.exploration.unexplored`) to re-time such a choice at the current context
until :data:`MIN_END_SAMPLES` of its samples lie within :data:`NEAR_CONTEXT` tokens of it (then the
window fits its own line through both contexts).

A shape's step also costs more when a prompt-lookup beam (:mod:`workers.redrafter.prompt_lookup`)
finds a match and adds its rows to the tree: on the AMX Xeon at batch 1 a 1x2 step verifying 3
rows took 6.75 ms, with 4 more lookup rows 9.2 ms (median of 548 and 206 steps). A window filled
during a request that copies from its prompt would price the shape for the next request, which may
copy nothing, 1.4x too high. So a tree sample is divided by the seed's time for the rows it
actually verified: the shape's own ``1 + num_beams * draft_len_per_beam`` rows plus the extra rows,
each priced at the seed's cost of a row at that batch size (:meth:`LiveStepCosts.row_s`: the slope
of the seed's step times against the shapes' rows), and the estimate for a shape prices in the
extra rows per request that recent trees carried (:attr:`LiveStepCosts.extra_rows`, a moving
average of weight :data:`EXTRA_ROWS_ALPHA`), as tokens per step count what the lookup beam accepts.

Buckets are powers of two: 1, 2, 3-4, 5-8, 9-16, ...
"""

from __future__ import annotations

import statistics
from collections import deque

from workers.speculation.goodput import Shape, StepCosts

Choice = Shape | None  # None: plain decoding

MIN_CONTEXT_SPREAD = 128  # context tokens between a window's extremes before it fits a line in the context
MIN_PAIR_GAP = 32  # context tokens two samples must differ by for their slope to count
MIN_END_SAMPLES = 3  # samples a line needs in each half of the contexts it spans
MIN_SLOPE_PAIRS = 8  # pairs of samples (MIN_PAIR_GAP apart) before the shared relative slope is used
MAX_RELATIVE_SLOPE = 0.01  # per context token: a step at most doubling every 100 tokens
REFIT_EVERY = 32  # samples between refits of the shared relative slope
CONTEXT_BIN = 64  # context tokens per range of the slope's history
BIN_SAMPLES = 8  # samples kept per range
HISTORY_AGE = 8192  # samples after which a range's sample leaves the slope's history
PAIR_REACH = 4  # a range pairs with the next this many sampled ranges of its window (bounds a refit's work)
NEAR_CONTEXT = MIN_CONTEXT_SPREAD  # context tokens within which a sample prices a read (covers_context)
EXTRA_ROWS_ALPHA = 0.02  # weight of the newest tree sample in the moving average of extra rows per request


def nominal_rows(shape: Shape) -> int:
    """Rows a tree of ``shape`` verifies without a prompt-lookup beam: the root and every beam's
    drafted tokens (ReDrafter's beams share only the root after distinct first tokens)."""
    return 1 + shape[0] * shape[1]


def context_line(samples: list[tuple[float, float]]) -> tuple[float, float] | None:
    """``(intercept, slope)`` of ``ratio = intercept + slope * context`` through ``samples`` of
    ``(context, ratio)``: Theil-Sen (the median of the slopes of pairs at least :data:`MIN_PAIR_GAP`
    tokens apart, clamped at 0: more context never makes a step cheaper; the intercept the median of
    ``ratio - slope * context``), robust to a few slow iterations. None when the contexts span less
    than :data:`MIN_CONTEXT_SPREAD` tokens, either half of the span holds fewer than
    :data:`MIN_END_SAMPLES` samples, or no pair is far enough apart (the caller takes the median)."""
    contexts = [c for c, _ in samples]
    lo, hi = (min(contexts), max(contexts)) if contexts else (0, 0)
    if hi - lo < MIN_CONTEXT_SPREAD:
        return None
    middle = (lo + hi) / 2
    below = sum(1 for c in contexts if c < middle)
    if min(below, len(contexts) - below) < MIN_END_SAMPLES:
        return None
    slopes = [(r1 - r0) / (c1 - c0) for i, (c0, r0) in enumerate(samples) for c1, r1 in samples[i + 1:]
              if abs(c1 - c0) >= MIN_PAIR_GAP]
    if not slopes:
        return None
    slope = max(0.0, statistics.median(slopes))
    return statistics.median(r - slope * c for c, r in samples), slope


def relative_slope(windows) -> float | None:
    """``k`` of ``ratio = level * (1 + k * context)`` shared by ``windows`` (each a list of
    ``(context, ratio)`` points, one list per (bucket, choice), sorted by context; the caller passes
    each context range's medians: their levels differ, ``k`` is common): the median
    over pairs of points of one window at least :data:`MIN_PAIR_GAP` tokens apart of
    ``(r1 - r0) / (r0 * c1 - r1 * c0)``, clamped to ``[0, MAX_RELATIVE_SLOPE]``. A point pairs with
    the next :data:`PAIR_REACH` points of its list (sorted by context: a refit's work grows linearly
    with the ranges, not as their square). None with fewer than :data:`MIN_SLOPE_PAIRS` pairs."""
    slopes = []
    for samples in windows:
        for i, (c0, r0) in enumerate(samples):
            for c1, r1 in samples[i + 1: i + 1 + PAIR_REACH]:
                den = r0 * c1 - r1 * c0
                if abs(c1 - c0) >= MIN_PAIR_GAP and den != 0:
                    slopes.append((r1 - r0) / den)
    if len(slopes) < MIN_SLOPE_PAIRS:
        return None
    return min(max(statistics.median(slopes), 0.0), MAX_RELATIVE_SLOPE)


def ordered_ratio(rows: int, own: float, peers: list[tuple[int, float]]) -> float:
    """``own`` (a tree's measured / seed ratio, the tree verifying ``rows`` rows) held within the
    ``peers``' ratios (``(rows, ratio)`` of trees better sampled): at most the smallest ratio of a
    peer with more rows, at least the largest of a peer with fewer. A bound from below wins over one
    from above when the peers themselves disagree (then the larger ratio is the safer price)."""
    above = [r for n, r in peers if n > rows]
    below = [r for n, r in peers if n < rows]
    if above:
        own = min(own, min(above))
    if below:
        own = max(own, max(below))
    return own


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
        next time that window is sampled; None: only ``window`` limits it. (The shared slope's
        history ages by :data:`HISTORY_AGE` instead.)

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
        self._k: float | None = None  # the shared relative slope (relative_slope); None: not yet fitted
        self._level: dict[tuple[int, Choice], float] = {}  # a window's median ratio brought to no context
        self._max_context = 0.0  # the longest context in the slope's history (the shared slope is read up to it)
        # the shared slope's history: (bucket, choice) -> context range -> newest (when, context, ratio) samples
        self._bins: dict[tuple[int, Choice], dict[int, deque[tuple[int, float, float]]]] = {}
        self.extra_rows = 0.0  # rows per request beyond the shape's own, moving average over tree samples
        self._row_s: dict[int, float] = {}  # batch size -> the seed's seconds per tree row
        self._merged: set[tuple[int, Choice]] = set()  # windows sampled with fewer rows than the shape's own
        # ratio() per (bucket, choice) at the current context: a tree's read computes its peers' own
        # ratios (3.2 us a read without it, 0.5 with it; read per request of every iteration); cleared
        # by every sample, context change and reseed
        self._memo: dict[tuple[int, Choice], float] = {}

    def at_context(self, context: float | None) -> None:
        """Read estimates at ``context`` (mean context tokens per request of the iteration about to
        be planned) from now on; None: every window's median, whatever the context."""
        if context != self.context:
            self._memo.clear()
        self.context = context

    def covers_context(self, b: int, choice: Choice) -> bool:
        """Whether the estimate for ``choice`` at ``b``'s bucket rests on samples near :attr:`context`:
        True with no context set, once the shared relative slope is fitted (it carries a price across
        contexts; a slope fitted at 0 says the context does not move the price: a lone request's
        context grows with every step, and with a fitted 0 read as unfitted, plain's window fell
        behind faster than probes could fill it and took every probe), or when at least
        :data:`MIN_END_SAMPLES` of the window's samples (all of them, in a smaller window) lie within
        :data:`NEAR_CONTEXT` tokens of it or have no context; False for a window never sampled."""
        if self.context is None or self._k is not None:
            return True
        window = self._samples.get((batch_bucket(b), choice))
        if not window:
            return False
        near = sum(1 for _, c, _ in window if c is None or abs(c - self.context) <= NEAR_CONTEXT)
        return near >= min(MIN_END_SAMPLES, len(window))

    @property
    def shapes(self) -> list[Shape]:
        return self.seed.shapes

    @property
    def tokens_per_step(self) -> dict[Shape, float]:
        return self.seed.tokens_per_step

    def seed_t(self, b: float, choice: Choice) -> float:
        """The seed's seconds per step at ``b`` for ``choice``."""
        return self.seed.t_plain(b) if choice is None else self.seed.t_spec(b, choice)

    def row_s(self, b: float) -> float:
        """The seed's seconds per extra tree row of every request of a step of ``b`` requests: the
        least-squares slope of its step times over the shapes' :func:`nominal_rows` (>= 0; 0 with fewer
        than two shapes of distinct rows: extra rows then cost nothing here and stay in the ratio)."""
        key = max(1, round(b))
        if key not in self._row_s:
            points = [(nominal_rows(s), self.seed.t_spec(key, s)) for s in self.seed.spec_s]
            mean_x = sum(x for x, _ in points) / len(points)
            mean_y = sum(y for _, y in points) / len(points)
            var = sum((x - mean_x) ** 2 for x, _ in points)
            slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0
            self._row_s[key] = max(slope, 0.0)
        return self._row_s[key]

    def _tree_seed_t(self, b: float, shape: Shape, extra: float) -> float:
        """The seed's seconds for a step of ``b`` requests with ``shape`` whose trees each carry
        ``extra`` rows (>= 0) beyond the shape's own."""
        return self.seed.t_spec(b, shape) + max(extra, 0.0) * self.row_s(b)

    def _expected_seed_t(self, b: float, choice: Choice) -> float:
        """The seed's seconds for ``choice`` at ``b``; a shape's with the extra rows per request recent
        trees carried (:attr:`extra_rows`)."""
        return self.seed_t(b, choice) if choice is None else self._tree_seed_t(b, choice, self.extra_rows)

    def t(self, b: float, choice: Choice) -> float:
        """Estimated seconds per step at ``b`` for ``choice`` (None: plain); a shape's with the extra
        rows per request recent trees carried (:attr:`extra_rows`)."""
        return self._expected_seed_t(b, choice) * self.ratio(max(1, round(b)), choice)

    def t_rows(self, b: float, shape: Shape, extra: float | None) -> float:
        """Estimated seconds per step at ``b`` with ``shape`` whose trees each carry ``extra`` rows beyond
        the shape's own (one request's own lookup rows; None: the recent average, as :meth:`t`)."""
        return self._tree_seed_t(b, shape, self.extra_rows if extra is None else extra) * \
            self.ratio(max(1, round(b)), shape)

    def t_plain(self, b: float) -> float:
        return self.t(b, None)

    def t_spec(self, b: float, shape: Shape) -> float:
        return self.t(b, shape)

    def ratio(self, b: int, choice: Choice) -> float:
        """measured / seed at ``b``'s bucket for ``choice`` (:meth:`own_ratio`); a tree shape's held
        between those of the trees sampled more at the bucket: at most the ratio of any with more
        rows, at least that of any with fewer (:func:`ordered_ratio`).

        Why: a shape in use fills its window every iteration, the others get a probe's two samples
        now and then, possibly in a slow second. Traced on the EPYC Zen 4 (BENCHMARKS.md section 19):
        at batch 1, 1x1 read 9.4 ms against 7.3 for the 1x2 in use, and at batch 4, 15.6 against
        14.7, where a tree of fewer rows cannot cost more; the estimates then chose the larger tree.
        A seed measured on this code orders the shapes right, so only their common level should
        move. A tree whose samples verified fewer rows than its shape's own (beams that merged, a
        search other than distinct-first) bounds no smaller tree: its ratio holds that saving.
        What this gives up: a seed that overprices larger trees against smaller ones (another
        machine's file trusted here) keeps a larger tree's estimate at the smaller tree's ratio
        until the larger one is sampled more."""
        bucket = batch_bucket(b)
        memo = self._memo.get((bucket, choice))
        if memo is not None:
            return memo
        own = self.own_ratio(b, choice)
        if choice is None:
            self._memo[bucket, choice] = own
            return own
        n = len(self._samples.get((bucket, choice), ()))
        rows = nominal_rows(choice)
        peers = [(nominal_rows(c), self.own_ratio(b, c)) for k, c in self._ratio
                 if k == bucket and c is not None and c != choice and len(self._samples[k, c]) > n
                 and not (nominal_rows(c) > rows and (k, c) in self._merged)]
        self._memo[bucket, choice] = ordered = ordered_ratio(rows, own, peers)
        return ordered

    def own_ratio(self, b: int, choice: Choice) -> float:
        """measured / seed at ``b``'s bucket for ``choice``: its own samples, else the nearest sampled
        bucket's (the smaller on a tie), else 1.0 (never sampled). At :attr:`context`: the window's
        own line in the context where it fits one (extended beyond its contexts by the shared slope),
        else its level under the shared relative slope once that is fitted, else its median."""
        bucket = batch_bucket(b)
        if (bucket, choice) not in self._ratio:
            sampled = [k for k, c in self._ratio if c == choice]
            if not sampled:
                return 1.0
            bucket = min(sampled, key=lambda k: (abs(k.bit_length() - batch_bucket(b).bit_length()), k))
        key = (bucket, choice)
        if self.context is None:
            return self._ratio[key]
        line = self._line.get(key)
        if line is not None:  # the window's own line within the contexts it sampled, the shared slope beyond
            intercept, slope, lo, hi = line
            held = min(max(self.context, lo), hi)
            beyond = (1.0 + self.relative_slope * self._seen(self.context)) / (1.0 + self.relative_slope * held)
            return max((intercept + slope * held) * beyond, 1e-3)
        if self._k and key in self._level:  # the shared relative slope, read up to the longest context seen
            return self._level[key] * (1.0 + self._k * self._seen(self.context))
        return self._ratio[key]

    def _seen(self, context: float) -> float:
        """``context`` held within 0 and the longest context of the slope's history."""
        return min(max(context, 0.0), self._max_context)

    @property
    def relative_slope(self) -> float:
        """The shared relative growth of a step's cost per context token (0 until fitted)."""
        return self._k or 0.0

    def probe_t(self, b: float, choice: Choice) -> float:
        """What a step of ``choice`` at ``b`` is expected to cost when probed: :meth:`t`, but a choice
        never sampled takes the median ratio of all that were (a seed several times off for one choice
        likely is for the others; :meth:`t` does not assume it, since it decides between them)."""
        if any(c == choice for _, c in self._ratio) or not self._ratio:
            return self.t(b, choice)
        return self._expected_seed_t(b, choice) * statistics.median(self._ratio.values())

    def samples(self, b: int, choice: Choice) -> int:
        """Live samples held for ``b``'s bucket and ``choice`` (at most ``window``)."""
        return len(self._samples.get((batch_bucket(b), choice), ()))

    def age(self, b: int, choice: Choice) -> int | None:
        """Samples observed since the newest one of ``b``'s bucket and ``choice`` (None: never sampled)."""
        window = self._samples.get((batch_bucket(b), choice))
        return self._now - window[-1][0] if window else None

    def observe(self, b: int, choice: Choice, seconds: float, context: float | None = None,
                rows: int | None = None) -> None:
        """One clean generation-only iteration: ``b`` requests, all plain (``choice`` None) or all
        drafting with ``choice``, took ``seconds``; ``context``: its mean context tokens per request
        (None: unknown; a window holding such a sample keeps its median); ``rows``: tree rows it
        verified in all (None: the shape's own, :func:`nominal_rows` per request).

        Raises:
            ValueError: ``b < 1``, ``seconds`` not > 0, or a shape the seed does not time.
        """
        if not seconds > 0:
            raise ValueError(f"step seconds must be > 0, got {seconds}")
        if choice is not None and choice not in self.seed.spec_s:
            raise ValueError(f"shape {choice} is not in the step-cost table")
        key = (batch_bucket(b), choice)
        self._now += 1
        self._memo.clear()
        base = self.seed_t(b, choice)
        if choice is not None and rows is not None:
            # rows beyond the shape's own: the lookup beam's; fewer rows (beams that merge, a beam
            # search's shared prefixes) belong to the shape and stay in its own ratio
            extra = max(rows / b - nominal_rows(choice), 0.0)
            if rows / b < nominal_rows(choice):
                self._merged.add(key)
            self.extra_rows += EXTRA_ROWS_ALPHA * (extra - self.extra_rows)
            base = self._tree_seed_t(b, choice, extra)
        ratio = seconds / base
        window = self._samples.setdefault(key, deque(maxlen=self.window))
        window.append((self._now, context, ratio))
        while self.max_age is not None and self._now - window[0][0] > self.max_age:
            window.popleft()  # never the sample just added
        self._ratio[key] = statistics.median(r for _, _, r in window)
        if context is not None:
            self._max_context = max(self._max_context, context)
            bins = self._bins.setdefault(key, {})
            bins.setdefault(int(context // CONTEXT_BIN), deque(maxlen=BIN_SAMPLES)).append((self._now, context, ratio))
        if self._now % REFIT_EVERY == 0:
            self._refit()
            for other in self._samples:
                self._set_level(other)
        else:
            self._set_level(key)
        line = None if any(c is None for _, c, _ in window) else context_line([(c, r) for _, c, r in window])
        if line is None:
            self._line.pop(key, None)
        else:
            contexts = [c for _, c, _ in window]
            self._line[key] = (*line, min(contexts), max(contexts))

    def _refit(self) -> None:
        """Refit the shared relative slope on the history's ranges (samples older than
        :data:`HISTORY_AGE` samples leave it), and the longest context it holds."""
        points, longest = [], 0.0
        for bins in self._bins.values():
            window = []
            for index in sorted(bins):
                q = bins[index]
                while q and self._now - q[0][0] > HISTORY_AGE:
                    q.popleft()
                if q:
                    window.append((statistics.median(c for _, c, _ in q), statistics.median(r for _, _, r in q)))
                    longest = max(longest, max(c for _, c, _ in q))
                else:
                    del bins[index]
            points.append(window)
        self._k, self._max_context = relative_slope(points), longest

    def _set_level(self, key: tuple[int, Choice]) -> None:
        """The window's level under the shared slope (none while the slope is unfitted, or when a
        sample of the window has no context)."""
        window = self._samples[key]
        if not self._k or any(c is None for _, c, _ in window):
            self._level.pop(key, None)
            return
        self._level[key] = statistics.median(r / (1.0 + self._k * c) for _, c, r in window)

    def reseed(self, seed: StepCosts) -> None:
        """Start over from ``seed`` (a fresh measurement): live samples so far are dropped, since their
        ratios were taken against the old seed."""
        self.seed = seed
        self._memo.clear()
        self._samples.clear()
        self._ratio.clear()
        self._line.clear()
        self._level.clear()
        self._k, self._max_context = None, 0.0
        self._bins.clear()
        self._row_s.clear()
        self._merged.clear()
        self.extra_rows = 0.0
