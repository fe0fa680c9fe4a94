"""LiveStepCosts: the seed table corrected by live samples (moving median of measured / seed)."""

import pytest

from workers.speculation.goodput import StepCosts, best_choice
from workers.speculation.step_times import LiveStepCosts, batch_bucket

SEED = StepCosts(plain_s={1: 0.010, 8: 0.040}, spec_s={(2, 2): {1: 0.020, 8: 0.120}},
                 tokens_per_step={(2, 2): 2.0})


def test_buckets_are_powers_of_two():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]
    with pytest.raises(ValueError, match="batch size"):
        batch_bucket(0)


def test_without_samples_the_seed_stands():
    live = LiveStepCosts(SEED)
    assert live.t_plain(1) == SEED.t_plain(1) and live.t_spec(4, (2, 2)) == SEED.t_spec(4, (2, 2))
    assert live.shapes == SEED.shapes and live.tokens_per_step == SEED.tokens_per_step
    assert best_choice(live, 1, {(2, 2): 2.0}) == best_choice(SEED, 1, {(2, 2): 2.0})


def test_samples_set_the_level_and_a_median_ignores_one_slow_step():
    live = LiveStepCosts(SEED, window=5)
    for seconds in (0.0034, 0.0033, 0.050, 0.0033):  # one step slowed by another process
        live.observe(1, None, seconds)
    assert live.t_plain(1) == pytest.approx(0.00335)
    assert live.samples(1, None) == 4 and live.samples(1, (2, 2)) == 0
    assert live.t_spec(1, (2, 2)) == 0.020  # never sampled: its seed


def test_an_unsampled_bucket_borrows_the_nearest_ratio_of_the_same_choice():
    live = LiveStepCosts(SEED)
    live.observe(1, (2, 2), 0.060)  # 3x the seed at batch 1
    live.observe(16, (2, 2), 2 * SEED.t_spec(16, (2, 2)))  # 2x the seed at batch 16
    assert live.ratio(2, (2, 2)) == pytest.approx(3.0)  # bucket 2: nearest is bucket 1
    assert live.ratio(8, (2, 2)) == pytest.approx(2.0)  # bucket 8: nearest is bucket 16
    assert live.t_spec(5, (2, 2)) == pytest.approx(SEED.t_spec(5, (2, 2)) * 2.0)
    assert live.ratio(4, None) == 1.0  # plain: no samples at all


def test_the_window_forgets_old_samples_and_reseed_starts_over():
    live = LiveStepCosts(SEED, window=3)
    for seconds in (0.030, 0.030, 0.030, 0.010, 0.010):
        live.observe(1, None, seconds)
    assert live.t_plain(1) == pytest.approx(0.010)
    live.reseed(StepCosts(plain_s={1: 0.005}, spec_s={(2, 2): {1: 0.007}}, tokens_per_step={(2, 2): 2.0}))
    assert live.t_plain(1) == 0.005 and live.samples(1, None) == 0


def test_bad_samples_are_refused():
    live = LiveStepCosts(SEED)
    with pytest.raises(ValueError, match="> 0"):
        live.observe(1, None, 0.0)
    with pytest.raises(ValueError, match="not in the step-cost table"):
        live.observe(1, (4, 4), 0.01)
    with pytest.raises(ValueError, match="window"):
        LiveStepCosts(SEED, window=0)


def test_a_probe_of_a_choice_never_sampled_expects_the_scale_seen_elsewhere():
    live = LiveStepCosts(SEED)
    assert live.probe_t(1, (2, 2)) == 0.020  # nothing sampled: the seed
    live.observe(1, None, 0.001)  # everything here runs 10x faster than the seed says
    assert live.probe_t(1, (2, 2)) == pytest.approx(0.002)
    assert live.t(1, (2, 2)) == 0.020  # decisions do not assume it
    assert live.probe_t(1, None) == pytest.approx(0.001)
