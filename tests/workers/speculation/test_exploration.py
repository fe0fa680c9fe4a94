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


def test_a_choice_sampled_only_far_from_the_current_context_is_probed_again():
    """Before the shared slope is fitted, a window timed only at 1,500 tokens of context says nothing
    of the price at 100: the choice is due again there until MIN_END_SAMPLES samples lie near it."""
    from workers.speculation.step_times import MIN_END_SAMPLES, NEAR_CONTEXT

    live = LiveStepCosts(SEED)
    for _ in range(8):
        live.observe(1, None, 0.010, context=100)
        live.observe(1, (1, 2), 0.030, context=1500)
    live.at_context(1500)
    assert unexplored(live, 1, None, 2) == [(2, 2), (4, 4)]  # never sampled
    live.at_context(1500 - NEAR_CONTEXT)  # near enough
    assert (1, 2) not in unexplored(live, 1, None, 2)
    live.at_context(100)
    assert not live.covers_context(1, (1, 2)) and live.covers_context(1, None)
    assert (1, 2) in unexplored(live, 1, None, 2) and None not in unexplored(live, 1, (1, 2), 2)
    for i in range(MIN_END_SAMPLES):
        assert (1, 2) in unexplored(live, 1, None, 2)
        live.observe(1, (1, 2), 0.013, context=100 + i)
    assert (1, 2) not in unexplored(live, 1, None, 2)
    assert live.t_spec(1, (1, 2)) < 0.015  # the window's own line, read at 100
    live.at_context(None)  # no context: medians, whatever the contexts sampled
    assert live.covers_context(1, (1, 2))


def test_the_budget_keeps_probes_to_their_fraction_of_the_time():
    budget = ProbeBudget(0.1)
    assert not budget.affords(0.01)  # nothing served yet
    for _ in range(9):
        budget.record(0.01, probe=False)
    assert budget.affords(0.01)  # 0.01 of 0.10
    budget.record(0.01, probe=True)
    assert not budget.affords(0.01) and budget.spent_s == 0.01
    assert not ProbeBudget(0.0).affords(1e-9)


def test_choices_only_far_from_the_context_take_probes_in_turn_not_cheapest_first():
    """Plain, the cheapest, re-timed near a lone request's growing context is still short of
    MIN_END_SAMPLES there: the trees, sampled longer ago, go before it; among those the oldest first."""
    live = LiveStepCosts(SEED)
    for shape in (None, (1, 2), (2, 2), (4, 4)):
        for _ in range(4):
            live.observe(1, shape, live.seed_t(1, shape), context=100)
    live.at_context(1000)
    assert live._k is None  # every sample at one context: no slope to carry prices across
    assert unexplored(live, 1, (1, 2), 2, refresh=512) == [None, (2, 2), (4, 4)]  # equal age: cheapest first
    live.observe(1, None, 0.010, context=1000)  # plain's probe: one sample near, still far by the rule
    assert not live.covers_context(1, None)
    assert unexplored(live, 1, (1, 2), 2, refresh=512) == [(2, 2), (4, 4), None]
    live.observe(1, (4, 4), 0.030, context=1000)
    assert unexplored(live, 1, (1, 2), 2, refresh=512) == [(2, 2), None, (4, 4)]
