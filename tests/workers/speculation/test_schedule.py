"""Speculation schedule: batch size -> (num_beams, draft_len_per_beam) or off."""

from __future__ import annotations

import pytest
import yaml
from pydantic import BaseModel

from workers.speculation.schedule import SpecSchedule, TablePolicy, choose_shape, derive_schedule, fixed_schedule, validate_schedule

TABLE = [
    {"max_batch_size": 1, "num_beams": 2, "draft_len_per_beam": 4},
    {"max_batch_size": 4, "num_beams": 2, "draft_len_per_beam": 2},
    {"max_batch_size": 6, "num_beams": 0, "draft_len_per_beam": 0},
    {"max_batch_size": 8, "num_beams": 1, "draft_len_per_beam": 2},
]


def test_choose_shape_by_number_of_generation_requests():
    table = validate_schedule(TABLE)
    shapes = [choose_shape(table, n) for n in range(0, 11)]
    assert shapes == [None, (2, 4), (2, 2), (2, 2), (2, 2), None, None, (1, 2), (1, 2), None, None]
    assert choose_shape("off", 1) is None
    assert validate_schedule("off") == "off"


def test_validation_names_the_row():
    with pytest.raises(ValueError, match="row 2: max_batch_size 4 must exceed row 1's 4"):
        validate_schedule([TABLE[1], TABLE[1]])
    with pytest.raises(ValueError, match="row 1 .*both be >= 1, or both 0"):
        validate_schedule([{"max_batch_size": 2, "num_beams": 2, "draft_len_per_beam": 0}])
    with pytest.raises(ValueError, match="row 1 .*max_batch_size"):
        validate_schedule([{"max_batch_size": 0, "num_beams": 1, "draft_len_per_beam": 1}])
    with pytest.raises(ValueError, match="row 1 .*num_beam"):
        validate_schedule([{"max_batch_size": 2, "num_beam": 1, "draft_len_per_beam": 1}])
    with pytest.raises(ValueError, match="expected 'off'"):
        validate_schedule("on")


def test_table_is_a_pydantic_config_field():
    class Engine(BaseModel):
        spec_schedule: SpecSchedule = "off"

    cfg = Engine(spec_schedule=TABLE)
    assert choose_shape(cfg.spec_schedule, 3) == (2, 2)
    assert Engine().spec_schedule == "off"
    assert Engine.model_validate(cfg.model_dump()) == cfg
    with pytest.raises(ValueError, match="row 2: max_batch_size 1 must exceed"):
        Engine(spec_schedule=TABLE[:1] * 2)


def test_derive_picks_best_shape_and_turns_off_at_large_batch():
    """Costs shaped like this project's CPU: verification grows with tree size and batch, so trees
    pay at batch 1-2, a small tree at 4, and nothing at 16 and above."""
    plain = {1: 0.040, 2: 0.042, 4: 0.046, 16: 0.070, 64: 0.200}
    tokens = {(1, 2): 1.7, (2, 2): 1.9, (4, 4): 2.3}
    tree_cost = {(1, 2): 1.3, (2, 2): 1.6, (4, 4): 2.4}  # step time relative to plain at batch 1
    growth = {1: 1.0, 2: 1.1, 4: 1.9, 16: 3.5, 64: 4.0}  # tree verification turns compute-bound
    spec = {(b, s): plain[b] * tree_cost[s] * growth[b] for b in plain for s in tokens}
    table = derive_schedule(plain, spec, tokens)
    rows = [(r.max_batch_size, r.shape) for r in table]
    # batch 1: 1x2 gives 1.7/1.3 = 1.31, 2x2 1.9/1.6 = 1.19, 4x4 0.96 (times plain's rate)
    # batch 4: 1x2 gives 1.7/(1.3*1.9) = 0.69 < 1: off; the trailing off rows are dropped
    assert rows == [(2, (1, 2))]
    assert choose_shape(table, 2) == (1, 2) and choose_shape(table, 4) is None


def test_derive_merges_equal_rows_keeps_inner_off_and_all_off():
    plain = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
    tokens = {(2, 2): 2.0}
    spec = {(1, (2, 2)): 1.5, (2, (2, 2)): 1.5, (4, (2, 2)): 2.5, (8, (2, 2)): 1.9}
    table = derive_schedule(plain, spec, tokens)
    assert [(r.max_batch_size, r.shape) for r in table] == [(2, (2, 2)), (4, None), (8, (2, 2))]
    assert validate_schedule([r.model_dump() for r in table]) == table
    assert derive_schedule(plain, {(1, (2, 2)): 2.0}, tokens) == "off"  # tie: plain wins
    assert derive_schedule(plain, {}, {}) == "off"


def test_derive_ties_prefer_the_smaller_tree():
    tokens = {(1, 2): 2.0, (2, 2): 2.0}
    table = derive_schedule({1: 1.0}, {(1, (2, 2)): 1.0, (1, (1, 2)): 1.0}, tokens)
    assert table[0].shape == (1, 2)


def test_derive_rejects_inconsistent_measurements():
    with pytest.raises(ValueError, match="batch 2 but plain_step_s does not"):
        derive_schedule({1: 1.0}, {(2, (1, 1)): 1.0}, {(1, 1): 1.5})
    with pytest.raises(ValueError, match=r"shape \(1, 1\) but tokens_per_step"):
        derive_schedule({1: 1.0}, {(1, (1, 1)): 1.0}, {})
    with pytest.raises(ValueError, match="must be > 0"):
        derive_schedule({1: 0.0}, {}, {})


def test_unquoted_yaml_off_means_off():
    """PyYAML reads ``spec_schedule: off`` as False; the config field takes it as "off"."""
    class Engine(BaseModel):
        spec_schedule: SpecSchedule

    assert Engine(**yaml.safe_load("spec_schedule: off")).spec_schedule == "off"


def test_fixed_schedule_uses_one_shape_up_to_its_batch_size():
    table = fixed_schedule((2, 3), 8)
    assert [choose_shape(table, n) for n in (1, 8, 9)] == [(2, 3), (2, 3), None]
    assert fixed_schedule(None, 8) == "off"


def test_a_table_policy_has_no_acceptance_estimate_before_its_first_iteration():
    """A replica asked for stats before it ran anything (a two-pool ingress warms its handles up at
    start) must not report tau 1.0, which reads as "drafts fail" and sent a test's requests to the
    plain pool; plain decoding still reports 1.0."""
    policy = TablePolicy(validate_schedule([{"max_batch_size": 1, "num_beams": 2, "draft_len_per_beam": 2}]))
    assert policy.stats()["tau"] is None
    assert policy.shape_for(4) is None and policy.stats()["tau"] == 1.0
    assert policy.shape_for(1) == (2, 2) and policy.stats()["tau"] is None  # drafting, nothing observed yet
    policy.observe({}, (2, 2), True, 2)
    assert policy.stats()["tau"] == 3.0
