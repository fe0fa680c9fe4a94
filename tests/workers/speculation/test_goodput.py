"""The goodput model and its live controller, as plain functions (no Ray, no model)."""

import json

import pytest

from workers.speculation.goodput import (
    StepCosts,
    best_choice,
    break_even_tau,
    interpolate,
    live_taus,
    plain_rate,
    spec_rate,
)
from workers.speculation.controller import ControllerSettings, SpecController

# Step costs shaped like the float32 calibration on our machines: a tree is nearly free at batch 1 and
# costs more and more as the batch grows.
COSTS = StepCosts(
    plain_s={1: 0.030, 2: 0.034, 4: 0.040, 8: 0.060, 16: 0.110, 32: 0.220},
    spec_s={(1, 2): {1: 0.036, 2: 0.042, 4: 0.056, 8: 0.082, 16: 0.210, 32: 0.450},
            (4, 4): {1: 0.045, 2: 0.070, 4: 0.110, 8: 0.190, 16: 0.400, 32: 0.800}},
    tokens_per_step={(1, 2): 1.65, (4, 4): 2.20},
)


def test_interpolation_is_linear_between_points_and_extends_the_end_segments():
    pts = {1: 1.0, 3: 3.0, 5: 4.0}
    assert interpolate(pts, 2) == pytest.approx(2.0)
    assert interpolate(pts, 4) == pytest.approx(3.5)
    assert interpolate(pts, 7) == pytest.approx(5.0)  # slope of the last segment
    assert interpolate({4: 2.0}, 8) == pytest.approx(4.0)  # one point: proportional above it
    assert interpolate({4: 0.02, 8: 0.06}, 1) == pytest.approx(0.02)  # below the first: never cheaper
    assert interpolate({16: 0.1, 32: 0.05}, 64) == pytest.approx(0.05)  # a noisy falling end: never below it
    with pytest.raises(ValueError, match="no measured points"):
        interpolate({}, 1)


def test_rates_follow_the_issue_formulas():
    assert plain_rate(COSTS, 4) == pytest.approx(4 / 0.040)
    assert spec_rate(COSTS, 4, (1, 2), 1.65) == pytest.approx(4 * 1.65 / 0.056)
    assert break_even_tau(COSTS, 8, (1, 2)) == pytest.approx(0.082 / 0.060)


def test_speculation_wins_at_low_load_and_loses_at_high_load():
    taus = dict(COSTS.tokens_per_step)
    assert best_choice(COSTS, 1, taus).shape == (4, 4)  # 2.2 / 45 ms beats 1.65 / 36 ms and 1 / 30 ms
    assert best_choice(COSTS, 8, taus).shape == (1, 2)
    assert best_choice(COSTS, 32, taus).shape is None
    per_request = [best_choice(COSTS, b, taus).rate / b for b in (1, 8, 32)]  # tokens/s one request gets
    assert per_request[0] > per_request[1] > per_request[2]


def test_low_live_acceptance_turns_speculation_down_by_itself():
    taus = live_taus(COSTS, (4, 4), 1.2)  # the traffic accepts far less than calibration did
    assert taus[(4, 4)] == pytest.approx(1.2)
    assert taus[(1, 2)] == pytest.approx(1 + 0.65 * 0.2 / 1.2)
    assert best_choice(COSTS, 1, taus).shape is None
    easy = live_taus(COSTS, (1, 2), 2.0)  # easier than calibration: speculation pays at larger batches
    assert easy == {(1, 2): 2.0, (4, 4): pytest.approx(2.0 + 2.20 - 1.65)}  # the same surplus for every shape
    assert best_choice(COSTS, 16, easy).shape == (1, 2)
    assert best_choice(COSTS, 16, dict(COSTS.tokens_per_step)).shape is None


def test_a_surplus_over_calibration_is_not_scaled_up_for_larger_trees():
    """Traffic that copies from its context is accepted by the prompt-lookup beam whatever the tree:
    a 1x2 tree at 4 tokens per step (calibration 1.65) says the 4x4 tree gains the same 2.35 tokens
    (4.55), not 4.6 times its calibrated 1.2 drafted tokens (6.5); so at batch 1 the 4x4 tree's
    slower step no longer buys its way in. Below calibration, accepted drafts still scale alike."""
    taus = live_taus(COSTS, (1, 2), 4.0)
    assert taus[(4, 4)] == pytest.approx(4.55)
    assert best_choice(COSTS, 1, taus).shape == (1, 2)  # 4.55 / 45 ms < 4.0 / 36 ms
    scaled = {s: 1 + (t - 1) * 3.0 / 0.65 for s, t in COSTS.tokens_per_step.items()}
    assert best_choice(COSTS, 1, scaled).shape == (4, 4)  # what scaling up chose
    assert live_taus(COSTS, (1, 2), 1.65) == COSTS.tokens_per_step  # at calibration: calibration
    hard = live_taus(COSTS, (4, 4), 1.6)
    assert hard[(1, 2)] == pytest.approx(1 + 0.65 * 0.6 / 1.2)


def test_calibration_json_round_trip_and_errors(tmp_path):
    data = {"plain_step_s": {"1": 0.03, "8": 0.06}, "spec_step_s": {"1:2x2": 0.04, "8:2x2": 0.1},
            "tokens_per_step": {"2x2": 1.8}}
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    costs = StepCosts.load(path)
    assert costs.shapes == [(2, 2)] and costs.t_spec(4.5, (2, 2)) == pytest.approx(0.07)
    del data["tokens_per_step"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="calibration.json: .*tokens_per_step"):
        StepCosts.load(path)
    with pytest.raises(ValueError, match="not a usable calibration file"):
        StepCosts.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="no speculative step times"):
        StepCosts(plain_s={1: 0.01}, spec_s={}, tokens_per_step={})
    with pytest.raises(ValueError, match="tokens_per_step of 2x2 must be >= 1"):
        StepCosts(plain_s={1: 0.01}, spec_s={(2, 2): {1: 0.02}}, tokens_per_step={(2, 2): 0.0})
    with pytest.raises(ValueError, match="plain_step_s: batch size must be >= 1"):
        StepCosts(plain_s={0: 0.01}, spec_s={(2, 2): {1: 0.02}}, tokens_per_step={(2, 2): 1.5})


def drive(controller: SpecController, batches: list[int]) -> list:
    return [controller.shape_for(b) for b in batches]


def test_hysteresis_bounds_the_switches_when_load_hovers_at_the_boundary():
    # 8 and 16 sit either side of the plain/spec boundary; load flapping between them every
    # iteration must not flap the decision.
    flapping = [8, 16] * 200
    eager = SpecController(COSTS, ControllerSettings(margin=0.0, patience=1))
    calm = SpecController(COSTS, ControllerSettings(margin=0.05, patience=8))
    eager_decisions, calm_decisions = drive(eager, flapping), drive(calm, flapping)
    assert eager.switches >= 300  # without hysteresis it follows every flap
    assert calm.switches <= 2
    assert sum(a != b for a, b in zip(calm_decisions, calm_decisions[1:])) <= 2


def test_alternating_challengers_still_unseat_a_beaten_choice():
    c = SpecController(COSTS, ControllerSettings(margin=0.05, patience=4))
    c.shape_for(32)  # plain
    taus = {(1, 2): 2.0, (4, 4): 3.0}  # both trees beat plain by far and take turns being best (b 1: 4x4, b 4: 1x2)
    c.taus = lambda: taus
    decisions = [c.shape_for(b) for b in [1, 4, 1, 4, 1, 4]]
    assert decisions[-1] is not None and c.switches == 1


def test_sustained_load_change_switches_once_after_patience():
    c = SpecController(COSTS, ControllerSettings(margin=0.05, patience=4))
    assert drive(c, [1] * 5) == [(4, 4)] * 5
    decisions = drive(c, [32] * 10)
    assert decisions[:3] == [(4, 4)] * 3 and decisions[3:] == [None] * 7
    assert c.switches == 1


def seconds(shape, b: int = 1) -> float:
    """The table's step time: what an engine on the machine COSTS describes would measure."""
    return COSTS.t_plain(b) if shape is None else COSTS.t_spec(b, shape)


def test_replica_tau_follows_acceptance_and_speculation_stops_on_hard_traffic():
    c = SpecController(COSTS, ControllerSettings(margin=0.05, patience=4, ema_alpha=0.2, probe_interval=4))
    assert c.shape_for(1) == (4, 4)
    for _ in range(60):  # every drafted step accepts nothing
        shape = c.shape_for(1)
        state = c.new_request_state()
        c.observe(state, shape, shape is not None, 0)
        c.observe_step(shape, 1, int(shape is not None), int(shape is None), seconds(shape))  # as the engine: probe budget
    assert c.taus()[(4, 4)] < 1.2 and c.tau == 1.0  # plain now
    assert c.current is None and c.switches >= 1
    assert c.stats()["shape"] is None


def test_replica_held_plain_by_acceptance_probes_and_recovers():
    c = SpecController(COSTS, ControllerSettings(margin=0.05, patience=2, ema_alpha=0.5, probe_interval=2))
    c.shape_for(1)
    state = c.new_request_state()
    while c.current is not None:
        shape = c.shape_for(1)
        c.observe(state, shape, shape is not None, 0)
        c.observe_step(shape, 1, int(shape is not None), int(shape is None), seconds(shape))
    probes = 0
    for _ in range(400):  # now the traffic accepts every draft
        shape = c.shape_for(1)
        if shape is not None:
            probes += 1
            c.observe(c.new_request_state(), shape, True, shape[1])
        c.observe_step(shape, 1, int(shape is not None), int(shape is None), seconds(shape))  # probes stay in budget
        if c.current is not None:
            break
    assert probes >= 1 and c.current is not None


def test_request_below_break_even_decodes_plain_and_probes():
    c = SpecController(COSTS, ControllerSettings(probe_interval=4, request_ema_alpha=0.5))
    state = c.new_request_state()
    assert c.drafts(state, 8, (1, 2))  # no history: the replica's estimate (1.65 > break-even 1.37)
    for _ in range(6):
        c.observe(state, (1, 2), True, 0)
    assert state.tau < break_even_tau(COSTS, 8, (1, 2))
    pattern = []
    for _ in range(8):
        drafts = c.drafts(state, 8, (1, 2))
        pattern.append(drafts)
        c.observe(state, (1, 2), drafts, 0)
    assert pattern == [False, False, False, True] * 2  # plain, with a probe every 4th step
    for _ in range(4):  # the probes find acceptance again
        c.observe(state, (1, 2), True, 2)
    assert c.drafts(state, 8, (1, 2))


def test_a_request_held_plain_by_its_own_probes_does_not_drag_the_replica_to_plain():
    """In a batch (a request alone drafts whenever the replica chose a tree: its choice already rests
    on that request's acceptance), a request that accepts nothing decodes plain on its own estimate
    and drafts every ``probe_interval``-th step. Those per-request probes are ordinary drafted steps
    of the replica: they weigh ``ema_alpha`` in its estimate, not ``probe_weight`` (which belongs to
    the replica's own probes after a plain stretch). Before, each weighed 0.25: two of them took the
    replica plain (measured on the AMX Xeon: the next request, accepting well, then began plain)."""
    b = 2
    c = SpecController(COSTS)
    hard = c.new_request_state()
    shapes = []
    for _ in range(60):
        shape = c.shape_for(b)
        drafts = shape is not None and c.drafts(hard, b, shape)
        c.observe(hard, shape, drafts, 0)
        shapes.append(shape)
    assert hard.tau < break_even_tau(COSTS, b, (1, 2))  # the request itself decodes plain...
    assert shapes[-1] is not None and c.current is not None  # ...the replica still speculates
    taus = c.taus()
    assert spec_rate(COSTS, b, c.current, taus[c.current]) > plain_rate(COSTS, b)


def test_a_request_alone_drafts_whenever_the_replica_chose_a_tree():
    """At batch 1 the per-request gate stands aside (the replica's estimate is the lone request's);
    at batch 2 the same request, accepting nothing, decodes plain between its probes."""
    c = SpecController(COSTS, ControllerSettings(probe_interval=4))
    state = c.new_request_state()
    for _ in range(8):
        c.observe(state, (1, 2), True, 0)
    assert state.tau < break_even_tau(COSTS, 2, (1, 2))
    assert all(c.drafts(state, 1, (1, 2)) for _ in range(4))
    assert not c.drafts(state, 2, (1, 2))


def test_the_controller_reports_no_tau_before_its_first_iteration():
    """Stats read before any iteration (a router or a pool ingress polling a fresh replica) carry no
    estimate instead of 1.0, which reads as "every draft fails"."""
    controller = SpecController(StepCosts(plain_s={1: 0.010}, spec_s={(2, 2): {1: 0.012}},
                                          tokens_per_step={(2, 2): 2.0}))
    assert controller.stats()["tau"] is None
    controller.shape_for(1)
    assert controller.stats()["tau"] == 2.0


def test_a_replica_held_plain_where_no_tree_could_pay_does_not_probe_trees():
    """At batch 32 here even a tree whose every draft token is accepted loses to plain: beyond the
    exploration samples of each choice, plain runs every iteration."""
    costs = StepCosts(plain_s=dict(COSTS.plain_s), tokens_per_step=dict(COSTS.tokens_per_step),
                      spec_s={s: {**r, 32: 1.5} for s, r in COSTS.spec_s.items()})
    c = SpecController(costs, ControllerSettings(margin=0.05, patience=2, probe_interval=2, explore_budget=0.5))
    drafted = 0
    for _ in range(400):
        shape = c.shape_for(32)
        drafted += shape is not None
        if shape is not None:
            c.observe(c.new_request_state(), shape, True, shape[1])  # what drafting there shows: every token taken
        c.observe_step(shape, 32, 32 * (shape is not None), 32 * (shape is None),
                       costs.t_plain(32) if shape is None else costs.t_spec(32, shape))
    assert c.current is None
    assert drafted <= 2 * c.settings.explore_samples * len(costs.shapes)  # a probe runs 2 iterations, 1 timed


def test_a_request_is_priced_with_its_own_lookup_rows():
    """Two requests accepting the same tokens per step: one whose trees carry 4 prompt-lookup rows
    (it copies from its context) and one whose trees carry none. Priced with the replica's average
    rows both decode alike; priced with their own (EPYC AVX2 at batch 1: a 1x1 step 1.45x plain
    without lookup rows, 2.8x with them) the one without rows drafts and the other decodes plain. In a
batch of two: a request alone drafts whenever the replica chose a tree."""
    from workers.speculation.step_times import nominal_rows

    b = 2
    seed = StepCosts(plain_s={1: 0.005, b: 0.006}, spec_s={(1, 1): {1: 0.007, b: 0.009}, (1, 2): {1: 0.009, b: 0.011}},
                     tokens_per_step={(1, 1): 1.7, (1, 2): 1.9})  # 2 ms per tree row of a request
    c = SpecController(seed, ControllerSettings(request_ema_alpha=0.5, probe_interval=100))
    copies, plain_text = c.new_request_state(), c.new_request_state()
    for _ in range(12):  # 2 tokens per step each
        for state, rows in ((copies, nominal_rows((1, 1)) + 4), (plain_text, nominal_rows((1, 1)))):
            c.observe(state, (1, 1), True, 1, rows)
    assert copies.extra_rows == 4 and plain_text.extra_rows == 0
    assert copies.tau == pytest.approx(2.0, abs=0.01) and plain_text.tau == pytest.approx(2.0, abs=0.01)
    # break-even at b: 9 / 6 = 1.5 tokens per step without lookup rows, (9 + 4 * 2) / 6 = 2.8 with them
    assert c.drafts(plain_text, b, (1, 1)) and not c.drafts(copies, b, (1, 1))
    unknown = c.new_request_state()  # no drafted step yet: the replica's average rows price it
    c.costs.extra_rows = 4.0
    assert c.drafts(unknown, b, (1, 1)) == (c.taus()[(1, 1)] >= break_even_tau(c.costs, b, (1, 1)))
    c.observe(unknown, None, False, 0, 1)  # a plain step reports no tree rows
    assert unknown.extra_rows is None


def test_pruning_threshold_is_what_a_row_costs_in_tokens_at_the_iterations_rate():
    """``prune_trees``: a draft token is verified when its path probability beats ``tau * row_s /
    t_spec`` (workers/redrafter/pruning.py): at batch 1 here a row costs 2 ms of a 7 ms step making
    1.7 tokens, so 0.486; at batch 8 rows cost more of the step, so a token must be surer; a slower
    live step of the shape scales the row's cost and the step alike; off, every tree is whole."""
    seed = StepCosts(plain_s={1: 0.005, 8: 0.014}, spec_s={(1, 1): {1: 0.007, 8: 0.033}, (1, 2): {1: 0.009, 8: 0.045}},
                     tokens_per_step={(1, 1): 1.7, (1, 2): 1.9})  # 2 ms per row at 1, 12 ms per 8 rows at 8
    on = SpecController(seed, ControllerSettings(prune_trees=True))
    assert on.min_draft_prob(1, (1, 1)) == pytest.approx(1.7 * 0.002 / 0.007)
    assert on.min_draft_prob(8, (1, 1)) == pytest.approx(1.7 * (0.012 / 8) / (0.033 / 8))
    assert on.min_draft_prob(8, (1, 1)) > on.min_draft_prob(1, (1, 1))
    assert on.min_draft_prob(0, (1, 1)) == 0.0
    for _ in range(20):  # live steps of 1x1 at batch 1 twice the seed's
        on.observe_step((1, 1), 1, 1, 0, 0.014, None, 2)
    assert on.min_draft_prob(1, (1, 1)) == pytest.approx(1.7 * 0.002 / 0.007, rel=0.02)
    off = SpecController(seed, ControllerSettings())
    assert off.min_draft_prob(1, (1, 1)) == 0.0


def test_the_log_says_whether_pruned_trees_are_in_effect(tmp_path, caplog):
    """``prune_trees`` is read only by the live goodput model: a fixed policy logs that it is not read,
    ``auto`` with a calibration that it is on, ``auto`` with ``draft_search: beam`` that it is ignored."""
    import logging

    from workers.speculation.options import SpeculationOptions
    from workers.speculation.policy import select_policy

    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"plain_step_s": {"1": 0.005}, "spec_step_s": {"1:1x1": 0.007},
                               "tokens_per_step": {"1x1": 1.7}}))
    cases = [
        ({"policy": "fixed"}, "is not read: the policy in effect is a table"),
        ({"policy": "auto", "calibration": str(cal)}, "cut by the drafter's confidence"),
        ({"policy": "auto", "calibration": str(cal), "draft_search": "beam"}, "is ignored with draft_search 'beam'"),
    ]
    for fields, said in cases:
        caplog.clear()
        opts = SpeculationOptions(**fields, auto={"prune_trees": True})
        with caplog.at_level(logging.INFO, logger="workers.speculation.policy"):
            selected = select_policy(opts, "gguf-avx2-int8", 16)
        assert said in caplog.text, (fields, caplog.text)
        if fields["policy"] == "auto":
            assert selected.policy.settings.prune_trees == (fields.get("draft_search") != "beam")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="workers.speculation.policy"):
        select_policy(SpeculationOptions(policy="auto", calibration=str(cal)), "gguf-avx2-int8", 16)
    assert "prune_trees" not in caplog.text  # off (the default): nothing to say
