"""Probing choices the live step times have not seen, at a bounded cost.

:class:`workers.speculation.step_times.LiveStepCosts` learns a choice's step time only from
iterations that run it, and the goodput model only runs the choice it rates best. A seed that makes
a good choice look slow would keep it unseen for good. So, like a request decoding plain for low
acceptance drafts once in a while (:meth:`workers.speculation.controller.SpecController.drafts`),
the replica now and then runs one iteration with a choice that has fewer than ``min_samples``
samples at the current batch-size bucket: the cheapest such choice first, and only while the time
spent in probes stays within ``fraction`` of all generation time (:class:`ProbeBudget`). Once every
choice of a bucket has its samples, that bucket is never probed again.
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


def unexplored(costs: LiveStepCosts, b: int, exclude: Choice, min_samples: int) -> list[Choice]:
    """Choices (None: plain, or a shape) other than ``exclude`` with fewer than ``min_samples`` live
    samples at ``b``'s bucket, cheapest estimated step first (ties: plain, then the smaller tree)."""
    choices: list[Choice] = [None, *costs.shapes]
    waiting = [c for c in choices if c != exclude and costs.samples(b, c) < min_samples]
    return sorted(waiting, key=lambda c: (costs.probe_t(b, c), c is not None, c[0] * c[1] if c else 0))
