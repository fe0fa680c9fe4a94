"""Probing choices without live step times: cheapest first, within a budget of the generation time."""

from workers.speculation.exploration import ProbeBudget, unexplored
from workers.speculation.goodput import StepCosts
from workers.speculation.step_times import LiveStepCosts

SEED = StepCosts(plain_s={1: 0.010}, spec_s={(1, 2): {1: 0.012}, (2, 2): {1: 0.015}, (4, 4): {1: 0.030}},
                 tokens_per_step={(1, 2): 1.6, (2, 2): 1.9, (4, 4): 2.2})


def test_unexplored_lists_choices_short_of_samples_cheapest_first():
    live = LiveStepCosts(SEED)
    assert unexplored(live, 1, (2, 2), 2) == [None, (1, 2), (4, 4)]
    live.observe(1, None, 0.010)
    live.observe(1, None, 0.010)
    live.observe(1, (4, 4), 0.003)  # one sample: cheap now, still short of 2
    assert unexplored(live, 1, (2, 2), 2) == [(4, 4), (1, 2)]
    # another bucket: nothing sampled there; (4, 4) and plain borrow their ratios from bucket 1, and (1, 2),
    # never sampled, is expected at the median ratio of the others (0.55)
    assert unexplored(live, 4, (2, 2), 2) == [(4, 4), (1, 2), None]
    assert unexplored(live, 1, None, 0) == []


def test_the_budget_keeps_probes_to_their_fraction_of_the_time():
    budget = ProbeBudget(0.1)
    assert not budget.affords(0.01)  # nothing served yet
    for _ in range(9):
        budget.record(0.01, probe=False)
    assert budget.affords(0.01)  # 0.01 of 0.10
    budget.record(0.01, probe=True)
    assert not budget.affords(0.01) and budget.spent_s == 0.01
    assert not ProbeBudget(0.0).affords(1e-9)
