"""Probing choices the live step times have not seen, at a bounded cost.

:class:`workers.speculation.step_times.LiveStepCosts` learns a choice's step time only from
iterations that run it, and the goodput model only runs the choice it rates best. A seed that makes
a good choice look slow would keep it unseen for good. So, like a request decoding plain for low
acceptance drafts once in a while (:meth:`workers.speculation.controller.SpecController.drafts`),
the replica now and then runs a choice (for two iterations: the controller times only the second,
the first pays for the switch) that has fewer than ``min_samples``
samples at the current batch-size bucket, or whose newest sample there is older than ``refresh``
samples (a step time measured while the replica warmed up or shared its cores must not decide for
good), or whose samples there all lie far from the current context
(:meth:`workers.speculation.step_times.LiveStepCosts.covers_context`: a price read far from where it
was measured must not decide for good either). Choices short of samples or stale go before those
only far from the context (:func:`unexplored` says the order within each), and a probe runs only
while the time spent in probes stays within ``fraction`` of all generation time (:class:`ProbeBudget`).
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.speculation.step_times import Choice, LiveStepCosts


@dataclass
class ProbeBudget:
    """Seconds spent in probe iterations against all generation iterations' seconds.

    fraction: the most of the generation time probes may take (0: never probe).
    """

    fraction: float
    spent_s: float = 0.0
    total_s: float = 0.0

    def affords(self, seconds: float) -> bool:
        """Whether a probe estimated to take ``seconds`` keeps probes within ``fraction``."""
        return self.spent_s + seconds <= self.fraction * (self.total_s + seconds)

    def record(self, seconds: float, probe: bool) -> None:
        """Count one generation iteration of ``seconds`` (a probe's also counts as spent)."""
        self.total_s += seconds
        if probe:
            self.spent_s += seconds


def unexplored(costs: LiveStepCosts, b: int, exclude: Choice, min_samples: int,
               refresh: int | None = None) -> list[Choice]:
    """Choices (None: plain, or a shape) other than ``exclude`` with fewer than ``min_samples`` live
    samples at ``b``'s bucket, or (``refresh`` given) a newest sample there older than ``refresh``
    samples, or samples there that do not cover ``costs``' current context (``covers_context``);
    those short of samples or stale first (a cheap choice whose window keeps falling behind a growing
    context must not take every probe from a stale one), cheapest estimated step first (ties: plain,
    then the smaller tree); then those only far from the context, the one sampled longest ago first
    (then the cheapest): while the shared slope is unfitted, a lone request's context outgrows every
    window within ~:data:`workers.speculation.step_times.NEAR_CONTEXT` steps, and cheapest-first gave
    plain's window every probe while the trees' prices stayed where the context had been."""
    def due(c: Choice) -> int | None:
        """0: too few samples or only old ones; 1: samples only far from the current context; None: not due."""
        if costs.samples(b, c) < min_samples:
            return 0
        age = costs.age(b, c)
        if refresh is not None and age is not None and age > refresh:
            return 0
        return None if costs.covers_context(b, c) else 1
    choices: list[Choice] = [None, *costs.shapes]
    waiting = {c: d for c in choices if c != exclude and (d := due(c)) is not None}
    def order(c: Choice) -> tuple:
        oldest_first = -(costs.age(b, c) or 0) if waiting[c] == 1 else 0
        return waiting[c], oldest_first, costs.probe_t(b, c), c is not None, c[0] * c[1] if c else 0
    return sorted(waiting, key=order)
