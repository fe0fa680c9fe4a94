"""``speculation.policy: auto``: the goodput model (:mod:`workers.speculation.goodput`) run live, with hysteresis.

The engine asks every iteration, for the number of generation requests ``b``:

- :meth:`SpecController.shape_for`: the draft-tree shape (or None: plain) with the highest expected
  tokens/s at ``b`` given the replica's live ``tau``; the current choice is kept unless another wins
  by ``margin`` (relative) for ``patience`` consecutive iterations, so load that hovers at a
  boundary does not flip the decision back and forth (public reports of dynamic speculation show
  throughput collapsing when a batch-size threshold flaps).
- :meth:`SpecController.drafts`: whether one request drafts in this iteration. A request whose own
  tokens-per-step estimate is below break-even for the batch (:func:`workers.speculation.goodput.break_even_tau`)
  decodes plain (its KV cache stays valid); every ``probe_interval``-th of its plain steps it drafts
  anyway, so its estimate can recover. Its step is priced with the rows its own trees carried beyond
  the shape's (the prompt-lookup beam's): on the EPYC AVX2, read off fixed 1x1's tokens per step and
  speedup per prompt category, a 1x1 step of qa prompts that copy passages cost ~2.8x a plain one,
  of generation prompts ~1.5x, and the replica's average rows priced both alike.
- :meth:`SpecController.observe`: after the iteration, the tokens each drafting request accepted.
  The replica's ``tau`` (for the shape in use) and each request's own are exponential moving
  averages (weight ``ema_alpha`` per step), seeded from calibration. A replica held plain drafts (two
  iterations) once in ``probe_interval * patience`` with the shape that would pay most if the traffic
  accepted at least what calibration did, so its estimate follows traffic that became easier, or that
  was always easier than the calibration prompts (calibration's acceptance alone never rules a tree
  out). Such a probe after a gap of ``g`` iterations weighs what ``g`` steps would have (at most
  ``probe_weight``), so a few probes move the estimate as far as continuous drafting would. A
  request's own probe (it decodes plain on its own estimate while the replica speculates) weighs
  ``ema_alpha`` like any drafted step: weighed as a replica probe, two probes of one request that
  accepted nothing took the AMX Xeon's replica plain, and the next request began plain.
- :meth:`SpecController.observe_step`: after a generation-only iteration, its seconds and mean
  context. Step times are the seed table corrected by these live samples, read at the context of the
  iteration being planned (:meth:`SpecController.observe_context`; a tree's step grows with context
  faster than a plain one's) (:class:`workers.speculation.step_times.LiveStepCosts`);
  a choice with too few samples at the current batch-size bucket, or samples older than
  ``explore_refresh``, runs now and then, within a budget of the generation time
  (:mod:`workers.speculation.exploration`), so neither a seed nor a slow first minute that makes a
  good choice look slow can hide it for good. A sample is the cost of *keeping* a choice: only an
  iteration that runs the same choice as the iteration just before it counts. The first iteration
  after a switch (or after a prompt chunk) pays for the switch: on the AMX Xeon a 2x2 tree timed
  right after plain steps took 15.4 ms against ~9 ms in a run of them, and trees probed one iteration
  at a time were all timed that way, so the model judged them 1.5-2x too slow (BENCHMARKS.md 14).
  So every probe lasts two iterations, and only the second is a sample.
- What a choice delivers caps what the model expects of it, from 2 requests up: the tokens/s of the
  last steady iterations of that batch size run on that answer of :meth:`SpecController.shape_for`
  (tokens emitted over seconds, :meth:`SpecController.delivered`). There the per-request gate drafts
  only the requests whose own acceptance pays, so a tree iteration is often *mixed* (some requests
  plain), and the model's ``b * tau / t_spec`` (``tau`` of the requests that drafted, a step with
  every request drafting) is not what the replica gets. Traced on the EPYC Zen 4 over HTTP at 5-8
  concurrent requests with a start-up measurement as seed: 96% of tree iterations were mixed, none of
  them a step-time sample, so the 1x1 tree kept its seed's 13.8 ms at 8 requests while its mixed
  steps took 20-30 ms (quartiles), and ``auto`` stayed on it against plain (0.90x of forced plain;
  BENCHMARKS.md section 23). At batch 1 there is no gate, and the model is the delivered rate's
  expectation.

Per-request state is a :class:`RequestSpecState` the engine keeps on the request (``Sequence.spec_state``).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from workers.redrafter.pruning import min_path_prob
from workers.speculation.exploration import ProbeBudget, unexplored
from workers.speculation.goodput import Shape, StepCosts, best_choice, live_taus, plain_rate, rate_of, spec_rate
from workers.speculation.shape import shape_text
from workers.speculation.step_times import Choice, LiveStepCosts, nominal_rows

REALIZED_SAMPLES = 4  # steady iterations of a choice at a batch size before its delivered tokens/s caps its estimate
DELIVERED_Z = 2.0  # standard errors of the mean tokens per iteration above it that a delivered rate reads


@dataclass(frozen=True)
class ControllerSettings:
    """Hysteresis and estimation settings (``speculation.auto`` in the config).

    margin: another choice must beat the current one's expected tokens/s by this fraction...
    patience: ...for this many consecutive iterations before the decision switches.
    ema_alpha: weight of the newest step in the replica's tokens-per-step moving average.
    request_ema_alpha: the same for each request's own estimate (fewer steps, so a larger weight).
    probe_interval: a request decoding plain for low acceptance drafts once every this many steps.
    step_window: live step-time samples per (batch-size bucket, choice) in the moving median.
    explore_samples: a choice with fewer live samples than this at a bucket is probed there...
    explore_budget: ...while probes take at most this fraction of the generation time (0: never).
    explore_refresh: a choice whose newest sample at the bucket is older than this many samples is
        probed again; samples older than this leave the median once it is re-sampled (so the
        probe's fresh samples alone price it: traced on the EPYC Zen 4 at batch 1, a 1x1 timed at
        1.8x its cost in the replica's first request kept that price through its first re-timing
        when samples lived twice as long, and the replica ran 1x2 for 1,150 iterations where 1x1
        was 1.3x faster).
    probe_weight: the most one probe of a replica held plain weighs in the replica's tokens-per-step
        average (after a gap of plain iterations).
    prune_trees: :meth:`SpecController.min_draft_prob` prices draft rows (False: every tree whole).
    """

    margin: float = 0.05
    patience: int = 8
    ema_alpha: float = 0.05
    request_ema_alpha: float = 0.2
    probe_interval: int = 8
    step_window: int = 16
    explore_samples: int = 2
    explore_budget: float = 0.05
    explore_refresh: int = 512
    probe_weight: float = 0.25
    prune_trees: bool = False


@dataclass
class RequestSpecState:
    """One request's speculation state under the live policy.

    tau: its own tokens per drafted step (moving average); None until its first drafted step (the
        replica's estimate stands in).
    plain_steps: generation steps since it last drafted (a probe is due every ``probe_interval``).
    extra_rows: rows its trees verified beyond the shape's own (the prompt-lookup beam's), moving
        average over its drafted steps with the weight of ``tau``; None until its first drafted step
        that reported rows (the replica's average stands in).
    """

    tau: float | None = None
    plain_steps: int = 0
    extra_rows: float | None = None


class SpecController:
    """One replica's speculation decision (the engine thread calls it; not thread-safe)."""

    live = True  # decides per iteration from live acceptance: every auto request may speculate

    def __init__(self, costs: StepCosts, settings: ControllerSettings = ControllerSettings(),
                 step_time: Callable[[int, Shape | None, float], float] | None = None):
        """costs: the seed table (a calibration, or the start-up measurement); live samples correct it.
        step_time(b, shape, measured_s): the seconds an iteration of ``b`` requests with ``shape`` (None:
        no tree drafted) counts as; default the measured seconds. Tests and simulations pass a
        deterministic cost model here, so decisions do not depend on the machine's speed."""
        self.costs = LiveStepCosts(costs, settings.step_window, max_age=settings.explore_refresh)
        self.step_time = step_time
        self.settings = settings
        self.budget = ProbeBudget(settings.explore_budget)
        self.probing = False  # the last shape_for answered with an exploration probe
        self.current: Shape | None = None
        self.started = False
        self.switches = 0
        self._streak = 0
        self._tau: tuple[Shape, float] | None = None  # (shape, live tokens per step): one assignment, so a
        # reader on another thread (routing stats) never pairs one shape with another's estimate
        self._plain_iterations = 0
        self._iteration = 0  # shape_for calls: the clock of the gap between drafted steps
        self._last_drafted: int | None = None  # the iteration of the last drafted step (None: none yet)
        self._hold: tuple[Shape | None] | None = None  # a probe's choice, run once more in the next iteration
        self._last_step: tuple[int, object] | None = None  # (iteration, choice) of the last observe_step
        # (batch size, answer) -> (iteration, tokens, seconds) of the last steady iterations that ran on
        # that answer of shape_for (delivered)
        self._delivered: dict[tuple[int, Choice], deque[tuple[int, int, float]]] = {}
        self._last_delivered: tuple[int, Choice] | None = None  # (iteration, answer) of the last observe_step
        self._answered: Choice = None  # what the last shape_for answered
        self._delivered_read: dict[tuple[int, Choice], tuple[tuple[int, int, int], float | None]] = {}

    # -- replica level ---------------------------------------------------------------------------

    def observe_context(self, context: float | None) -> None:
        """The mean context tokens per generation request of the iteration about to be planned: step
        times are read at it (:meth:`workers.speculation.step_times.LiveStepCosts.at_context`)."""
        self.costs.at_context(context)

    @property
    def shapes(self) -> list[Shape]:
        """Every shape it may choose (the engine sizes its KV cache for the largest tree)."""
        return self.costs.shapes

    def taus(self) -> dict[Shape, float]:
        """Live tokens per step of every calibrated shape (see :func:`workers.speculation.goodput.live_taus`)."""
        shape, tau = self._tau or (None, None)
        return live_taus(self.costs, shape, tau)

    @property
    def tau(self) -> float:
        """Live tokens per step of the shape in use; 1.0 while decoding plain."""
        return 1.0 if self.current is None else self.taus()[self.current]

    def shape_for(self, b: int) -> Shape | None:
        """The shape for an iteration with ``b`` generation requests (None: plain)."""
        choice = self._shape_for(b)
        self._answered = choice
        return choice

    def _shape_for(self, b: int) -> Shape | None:
        self.probing = False
        self._iteration += 1
        if b < 1 or not self.costs.shapes:
            self._hold = None
            return None
        if self._hold is not None:  # a probe's second iteration: the one timed (see observe_step)
            (choice,), self._hold, self.probing = self._hold, None, True
            return choice
        taus = self.taus()
        best = best_choice(self.costs, b, taus, rate=lambda c: self.rate(b, c, taus))
        if not self.started:
            self.started, self.current = True, best.shape
            return self.current
        if best.shape != self.current and best.rate > self.rate(b, self.current, taus) * (1 + self.settings.margin):
            self._streak += 1  # the current choice is beaten; switch to the latest winner after patience
        else:
            self._streak = 0
        if self._streak >= self.settings.patience:
            self.current, self._streak, self.switches = best.shape, 0, self.switches + 1
        choice = self._maybe_probe(b) if self.current is None else self.current
        return choice if self.probing else self._explore(b, choice)

    def rate(self, b: int, choice: Choice, taus: dict[Shape, float]) -> float:
        """Expected tokens/s of ``choice`` at ``b``: the goodput model's
        (:func:`workers.speculation.goodput.rate_of`), from 2 requests up at most what the choice
        delivered at ``b`` (:meth:`delivered`; see the module docstring)."""
        model = rate_of(self.costs, b, choice, taus)
        delivered = self.delivered(b, choice) if b >= 2 else None
        return model if delivered is None else min(model, delivered)

    def delivered(self, b: int, choice: Choice) -> float | None:
        """Tokens/s the replica delivered in its last steady iterations of ``b`` requests that
        :meth:`shape_for` answered with ``choice`` (a tree's mixed iterations, and plain's with
        requests forcing speculation, count as they ran; at most
        ``step_window`` of them, none older than ``explore_refresh`` iterations): an upper bound on
        their mean emitted tokens (:data:`DELIVERED_Z` standard errors above it) over their median
        seconds; None with fewer than :data:`REALIZED_SAMPLES` of them.

        - Per batch size, not bucket: a bucket's iterations of fewer requests emit fewer tokens, and
          a tree in use at 3 and 4 requests read below what it delivered at either (a review's
          simulation: 402 tok/s against 424 and 451).
        - The median seconds, as the step-time estimates take them: with a mean, the odd iteration
          slowed by another process on the core would price a tree against a plain step's median.
        - An upper bound, since the cap only lowers an estimate: a window of mixed iterations is noisy,
          and at 2 requests the raw mean's dips parked the replica on plain (a review's simulation:
          323 against 339 tok/s without the cap, 334 with the bound; BENCHMARKS.md section 23)."""
        window = self._delivered.get((b, choice))
        if not window:
            return None
        while window and self._iteration - window[0][0] > self.settings.explore_refresh:
            window.popleft()
        if len(window) < REALIZED_SAMPLES:
            return None
        state = (window[0][0], window[-1][0], len(window))  # a window changes only at its ends
        memo = self._delivered_read.get((b, choice))
        if memo is not None and memo[0] == state:
            return memo[1]
        seconds = statistics.median(s for _, _, s in window)
        tokens = [t for _, t, _ in window]
        bound = statistics.fmean(tokens) + DELIVERED_Z * statistics.stdev(tokens) / len(tokens) ** 0.5
        rate = bound / seconds if seconds > 0 else None
        self._delivered_read[b, choice] = (state, rate)  # read per choice every iteration: ~30 us a computation
        return rate

    def min_draft_prob(self, b: int, shape: Shape) -> float:
        """The path probability a draft token needs to be verified in an iteration of ``b`` requests with
        ``shape`` (0 with ``prune_trees`` off; :func:`workers.redrafter.pruning.min_path_prob`): the
        iteration makes ``b * tau / t_spec`` tokens/s, and one more row of one request costs
        ``row_s / b`` seconds (the seed's per-row slope at ``b`` times the live correction of the
        shape's step time), so a row pays when its path probability exceeds ``tau * row_s / t_spec``."""
        if not self.settings.prune_trees or b < 1:
            return 0.0
        t = self.costs.t_spec(b, shape)
        row_s = self.costs.row_s(b) * self.costs.ratio(max(1, round(b)), shape)
        return min_path_prob(row_s / b, b * self.taus()[shape] / t) if t > 0 else 0.0

    def _explore(self, b: int, choice: Shape | None) -> Shape | None:
        """``choice``, or instead the cheapest choice with too few step-time samples at ``b``'s bucket
        (or only old ones) when the probe budget affords its estimated step."""
        waiting = unexplored(self.costs, b, choice, self.settings.explore_samples, self.settings.explore_refresh)
        self.probing = bool(waiting) and self.budget.affords(self.costs.probe_t(b, waiting[0]))
        if not self.probing:
            return choice
        self._hold = (waiting[0],)
        return waiting[0]

    def _maybe_probe(self, b: int) -> Shape | None:
        """While plain: once in ``probe_interval * patience`` iterations (when the probe budget affords
        it) drafts, for two iterations (see :meth:`observe_step`), with the shape of the highest
        expected tokens/s at ``b`` if the traffic accepts at least what calibration's prompts did (each shape's tau the larger of the two), so the live
        estimate can rise again. Every request drafts in it. Only shapes that would beat plain by
        ``margin`` with every draft token accepted (``draft_len_per_beam + 1`` tokens per step) are
        probed: where even that loses (large batches), plain stays without a probe."""
        self._plain_iterations += 1
        if self._plain_iterations < self.settings.probe_interval * self.settings.patience:
            return None
        plain = plain_rate(self.costs, b) * (1 + self.settings.margin)
        could_pay = [s for s in self.costs.shapes if spec_rate(self.costs, b, s, s[1] + 1) > plain]
        if not could_pay:  # not even a fully accepted tree beats plain at b: nothing to learn by drafting
            self._plain_iterations = 0
            return None
        live = self.taus()
        hopeful = {s: max(t, live[s]) for s, t in self.costs.tokens_per_step.items()}
        shape = max(could_pay, key=lambda s: rate_of(self.costs, b, s, hopeful))
        if not self.budget.affords(self.costs.t(b, shape)):
            return None
        self._plain_iterations, self.probing, self._hold = 0, True, (shape,)
        return shape

    # -- request level ---------------------------------------------------------------------------

    def new_request_state(self) -> "RequestSpecState":
        return RequestSpecState()

    def drafts(self, state: "RequestSpecState", b: int, shape: Shape) -> bool:
        """Whether a request with ``state`` drafts in an iteration of ``b`` requests with ``shape``
        (every request drafts in an exploration probe, whose step time is the point).

        A request alone (``b <= 1``) always drafts when the replica chose a tree: the replica's choice
        was made on that request's own acceptance (its live tau at batch 1 is this request's), so a
        second, per-request gate only second-guesses it with a noisier estimate. Measured on the EPYC
        Zen 4 (BENCHMARKS.md section 19): gated requests decoded 19-39% of their steps plain where
        drafting still paid, and ``auto`` ran at 0.92-0.97x of a fixed 1x1 tree, against 0.98x without
        the gate at batch 1."""
        if self.probing or b <= 1:
            return True
        tau = state.tau if state.tau is not None else self.taus()[shape]
        # break-even priced with its own lookup rows (the replica's average until it has drafted)
        if tau >= self.costs.t_rows(b, shape, state.extra_rows) / self.costs.t(b, None):
            return True
        return state.plain_steps + 1 >= self.settings.probe_interval  # a probe

    def observe(self, state: "RequestSpecState", shape: Shape | None, drafted: bool, accepted: int,
                rows: int | None = None) -> None:
        """Record one generation step of a request: ``accepted`` draft tokens if it ``drafted``, its tree
        having verified ``rows`` rows (None: not reported)."""
        if not drafted or shape is None:
            state.plain_steps += 1
            return
        state.plain_steps = 0
        tokens = 1.0 + accepted
        taus = self.taus()
        if state.tau is None:
            state.tau = taus[shape]
        r = self.settings.request_ema_alpha
        state.tau = (1 - r) * state.tau + r * tokens
        if rows is not None:
            extra = max(rows - nominal_rows(shape), 0)
            state.extra_rows = extra if state.extra_rows is None else (1 - r) * state.extra_rows + r * extra
        a = self.settings.ema_alpha  # a new shape starts from the estimate carried over to it
        # iterations since the last drafted step (0: the same one; the first drafted step has no gap)
        gap = 1 if self._last_drafted is None else self._iteration - self._last_drafted
        if gap > 1 and self.probing:  # a replica probe after plain iterations weighs what the steps in between would have
            a = max(a, min(self.settings.probe_weight, 1.0 - (1.0 - a) ** gap))
        self._last_drafted = self._iteration
        self._tau = (shape, (1 - a) * taus[shape] + a * tokens)

    def observe_step(self, shape: Shape | None, num_generation: int, num_full_trees: int, num_plain: int,
                     seconds: float, context: float | None = None, rows: int | None = None,
                     timed: bool = True, tokens: int | None = None) -> None:
        """Record one generation-only iteration (no prompt chunk): ``num_generation`` requests, of which
        ``num_full_trees`` drafted a whole tree of ``shape`` and ``num_plain`` none, in ``seconds``,
        at ``context`` mean context tokens per request (None: unknown), verifying ``rows`` tree rows
        in all (None: unknown; a prompt-lookup beam adds rows to a shape's tree, see
        :class:`workers.speculation.step_times.LiveStepCosts`).
        Only a clean iteration (all plain, or all full trees) that runs the same choice as the
        iteration just before it is a step-time sample (the first after a switch or a prompt chunk
        pays for the switch), and only if ``timed``: an iteration the thread policy
        (:mod:`workers.thread_policy`) ran on a count it was probing, not the one it settled on, times
        the thread count, not the choice. ``tokens``: the tokens its requests emitted (None: not
        counted); a timed iteration on the same answer of :meth:`shape_for` as the one before it adds
        them to what that answer delivered (:meth:`delivered`), whatever ran under it.
        (Traced on the EPYC Zen 4 at batch 1: 5-7% of tree steps
        were such probes, a 1x2 step at 13-14 ms on 1 thread against 9.3 on 2; a shape in steady use
        has a window median that shrugs them off, but a rarely run shape's few samples did not, and
        its estimate rose above a larger tree's; BENCHMARKS.md section 19.) Every iteration counts in
        the probe budget."""
        if num_generation < 1 or seconds <= 0:
            return
        if self.step_time is not None:
            seconds = self.step_time(num_generation, shape if num_plain < num_generation else None, seconds)
        self.budget.record(seconds, self.probing)
        choice = None if num_plain == num_generation else shape if num_full_trees == num_generation else "mixed"
        steady = self._last_step == (self._iteration - 1, choice)
        self._last_step = (self._iteration, choice)
        # what the policy's answer delivered, whatever ran under it: a tree's mixed iterations, one whose
        # requests the gate all kept plain, or plain with requests that force speculation drafting alone
        # (Scheduler.schedule's forced_shape: they make plain dearer, not the tree)
        answer = self._answered
        if tokens is not None and timed and self._last_delivered == (self._iteration - 1, answer):
            window = self._delivered.setdefault((num_generation, answer), deque(maxlen=self.settings.step_window))
            window.append((self._iteration, tokens, seconds))
        self._last_delivered = (self._iteration, answer)
        if steady and timed and (choice is None or choice in self.costs.seed.spec_s):
            self.costs.observe(num_generation, choice, seconds, context, rows if choice is not None else None)

    def stats(self) -> dict:
        """For routing stats and responses: current shape, live tau (None before the first iteration:
        no estimate yet, not plain decoding), switches so far."""
        shape = self.current
        return {"shape": shape_text(shape),
                "tau": round(self.tau, 4) if self.started else None,
                "switches": self.switches}
