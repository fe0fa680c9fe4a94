"""LiveStepCosts: the seed table corrected by live samples (moving median of measured / seed)."""

import pytest

from workers.speculation.goodput import StepCosts, best_choice
from workers.speculation.step_times import EXTRA_ROWS_ALPHA, MIN_END_SAMPLES, LiveStepCosts, batch_bucket

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


def test_samples_over_contexts_are_read_at_the_context_of_the_step():
    """A step's cost grows with the context its requests attend over: samples spread over contexts
    give a line in the context (robust to a slow iteration), read at the context of the iteration
    being planned; without a context the window's median stands."""
    costs = LiveStepCosts(SEED, window=16)
    for i, ctx in enumerate(range(100, 1600, 100)):
        costs.observe(1, (2, 2), SEED.t_spec(1, (2, 2)) * (1.0 + ctx / 1000) * (3.0 if i == 5 else 1.0), context=ctx)
    costs.at_context(100)
    assert costs.t_spec(1, (2, 2)) == pytest.approx(SEED.t_spec(1, (2, 2)) * 1.1, rel=0.02)
    costs.at_context(1500)
    assert costs.t_spec(1, (2, 2)) == pytest.approx(SEED.t_spec(1, (2, 2)) * 2.5, rel=0.02)
    costs.at_context(None)
    assert costs.t_spec(1, (2, 2)) == pytest.approx(SEED.t_spec(1, (2, 2)) * 1.9)  # the median
    assert costs.t_plain(1) == SEED.t_plain(1)  # another choice: still the seed


def test_contexts_too_close_or_falling_costs_keep_the_median():
    close = LiveStepCosts(SEED, window=16)
    for ctx, ratio in ((400, 1.0), (450, 1.2), (420, 1.4)):  # 50 tokens apart: no line
        close.observe(1, None, SEED.t_plain(1) * ratio, context=ctx)
    close.at_context(2000)
    assert close.t_plain(1) == pytest.approx(SEED.t_plain(1) * 1.2)
    falling = LiveStepCosts(SEED, window=16)
    for ctx, ratio in ((100, 2.0), (150, 1.9), (200, 1.8), (1000, 1.2), (1050, 1.1), (1100, 1.0)):
        falling.observe(1, None, SEED.t_plain(1) * ratio, context=ctx)  # cheaper with more context: noise, not a slope
    falling.at_context(5000)
    assert falling.t_plain(1) == pytest.approx(SEED.t_plain(1) * 1.5)
    unknown = LiveStepCosts(SEED, window=16)  # a sample without a context: the window keeps its median
    for ctx, ratio in ((100, 1.0), (600, 1.5), (None, 1.2), (1100, 2.0)):
        unknown.observe(1, None, SEED.t_plain(1) * ratio, context=ctx)
    unknown.at_context(1100)
    assert unknown.t_plain(1) == pytest.approx(SEED.t_plain(1) * 1.35)


def test_a_line_is_not_read_beyond_the_contexts_sampled():
    costs = LiveStepCosts(SEED, window=16)
    for ctx in (200, 220, 240, 360, 380, 400):
        costs.observe(1, None, SEED.t_plain(1) * (1.0 + ctx / 100), context=ctx)
    costs.at_context(100_000)  # held at the longest context sampled (400): ratio 5, not 1,001
    assert costs.t_plain(1) == pytest.approx(SEED.t_plain(1) * 5.0)
    costs.at_context(1)  # and at the shortest (200): ratio 3
    assert costs.t_plain(1) == pytest.approx(SEED.t_plain(1) * 3.0)


def test_one_sample_far_from_the_others_makes_no_line():
    """Seen on the AMX Xeon: fifteen 1x2 steps (here 2x2) at 170-190 tokens of context and one at 480 (a step
    whose prompt-lookup beam added rows) fitted a line that priced 1x2 at 480+ tokens 2.5x its cost.
    Each half of the span needs MIN_END_SAMPLES samples before the context is read; until then the
    window's median stands."""
    costs = LiveStepCosts(SEED, window=16)
    for i in range(15):
        costs.observe(1, (2, 2), SEED.t_spec(1, (2, 2)) * 0.8, context=170 + i)
    costs.observe(1, (2, 2), SEED.t_spec(1, (2, 2)) * 1.4, context=480)
    costs.at_context(550)
    assert costs.t_spec(1, (2, 2)) == pytest.approx(SEED.t_spec(1, (2, 2)) * 0.8)
    for i in range(MIN_END_SAMPLES - 1):  # enough samples at the far end: now a line
        costs.observe(1, (2, 2), SEED.t_spec(1, (2, 2)) * 1.4, context=470 + i)
    assert costs.t_spec(1, (2, 2)) == pytest.approx(SEED.t_spec(1, (2, 2)) * 1.4, rel=0.05)


def test_a_window_sampled_at_one_context_is_read_elsewhere_through_the_shared_slope():
    """Seen on the AMX Xeon: 1x2 timed only during a long request (550-620 tokens), then priced at
    that for short ones (2.3x plain instead of ~1.7x), so the replica decoded plain. Steps of every
    choice grew by nearly the same fraction per context token there; plain steps sampled over many
    contexts teach the shared slope, which reads the tree's window at short context."""
    costs = LiveStepCosts(SEED, window=16)
    k = 0.0007  # relative growth per context token

    def grow(ctx):
        return 1.0 + k * ctx

    for ctx in range(100, 740, 40):  # plain over many contexts
        costs.observe(1, None, SEED.t_plain(1) * grow(ctx), context=ctx)
    for ctx in range(550, 630, 5):  # the tree at long context only
        costs.observe(1, (2, 2), SEED.t_spec(1, (2, 2)) * 0.9 * grow(ctx), context=ctx)
    assert costs.relative_slope == pytest.approx(k, rel=0.05)
    costs.at_context(100)
    assert costs.t_spec(1, (2, 2)) == pytest.approx(SEED.t_spec(1, (2, 2)) * 0.9 * grow(100), rel=0.02)
    assert costs.t_plain(1) == pytest.approx(SEED.t_plain(1) * grow(100), rel=0.02)
    costs.at_context(5000)  # read no further than the longest context sampled (720)
    assert costs.t_spec(1, (2, 2)) == pytest.approx(SEED.t_spec(1, (2, 2)) * 0.9 * grow(720), rel=0.02)
    costs.at_context(None)  # no context: the window's median, as before
    assert costs.t_spec(1, (2, 2)) == pytest.approx(SEED.t_spec(1, (2, 2)) * 0.9 * grow(587.5), rel=0.02)


def test_rows_a_lookup_beam_adds_are_priced_per_row_not_charged_to_the_shape():
    """A 1x2 tree verifies 3 rows, 7 when the prompt-lookup beam finds a match (AMX Xeon, batch 1:
    6.75 vs 9.2 ms). Trees timed during a request that copies its prompt must not make the shape look
    1.5x dearer for the next request: a sample is divided by the seed's time for the rows it
    verified (the seed's cost per row: the slope of its step times over the shapes' rows), and the
    estimate adds the extra rows recent trees carried (a moving average)."""
    per_row = 0.001  # the seed: 5 ms plus 1 ms per row verified
    seed = StepCosts(plain_s={1: 0.006}, spec_s={(1, 2): {1: 0.008}, (2, 2): {1: 0.010}, (4, 4): {1: 0.022}},
                     tokens_per_step={(1, 2): 1.8, (2, 2): 2.0, (4, 4): 2.3})
    costs = LiveStepCosts(seed, window=16)
    assert costs.row_s(1) == pytest.approx(per_row)
    for _ in range(16):  # trees with 4 lookup rows, timed exactly as the seed prices 7 rows
        costs.observe(1, (1, 2), 0.005 + 7 * per_row, rows=7)
    assert costs.extra_rows == pytest.approx(4 * (1 - (1 - EXTRA_ROWS_ALPHA) ** 16))
    assert costs.t_spec(1, (1, 2)) == pytest.approx(0.008 + costs.extra_rows * per_row)  # not 0.012
    assert costs.t_spec(1, (2, 2)) == pytest.approx(0.010 + costs.extra_rows * per_row)  # never sampled: the seed, same rows
    for _ in range(200):  # the next requests copy nothing: 3-row trees
        costs.observe(1, (1, 2), 0.008, rows=3)
    assert costs.t_spec(1, (1, 2)) == pytest.approx(0.008, rel=0.02)


def test_extra_rows_at_batch_8_are_priced_per_request_row_and_merged_trees_do_not_go_negative():
    """At batch b the seed's cost per row is the slope over rows per request, so it already covers
    all b requests (a reviewer found it charged b times). Trees with fewer rows than the shape's own
    (beams that merge) do not drive the shared extra rows below zero: that saving is the shape's."""
    seed = StepCosts(plain_s={8: 0.020}, spec_s={(1, 2): {8: 0.005 + 3 * 0.004}, (2, 2): {8: 0.005 + 5 * 0.004},
                                                 (4, 4): {8: 0.005 + 17 * 0.004}},
                     tokens_per_step={(1, 2): 1.8, (2, 2): 2.0, (4, 4): 2.3})
    costs = LiveStepCosts(seed, window=16)
    assert costs.row_s(8) == pytest.approx(0.004)
    for _ in range(16):  # every request's 1x2 tree carries 4 lookup rows: 7 x 8 rows
        costs.observe(8, (1, 2), 0.005 + 7 * 0.004, rows=7 * 8)
    assert costs.t_spec(8, (1, 2)) == pytest.approx(0.017 + costs.extra_rows * 0.004)  # ratio 1
    assert costs.probe_t(8, (2, 2)) == pytest.approx(costs.t_spec(8, (2, 2)))  # probes priced as decisions
    merged = LiveStepCosts(seed, window=16)
    for _ in range(64):  # 4x4 trees whose beams merged into 5 rows
        merged.observe(8, (4, 4), 0.005 + 5 * 0.004, rows=5 * 8)
    assert merged.extra_rows == 0.0
    assert merged.t_spec(8, (1, 2)) == pytest.approx(0.017)


ORDERED_SEED = StepCosts(plain_s={1: 0.0055}, spec_s={(1, 1): {1: 0.008}, (1, 2): {1: 0.0104}, (2, 2): {1: 0.0112}},
                         tokens_per_step={(1, 1): 1.70, (1, 2): 1.89, (2, 2): 2.08})


def test_a_sparsely_sampled_smaller_tree_is_never_priced_above_the_larger_tree_in_use():
    """The trace of BENCHMARKS.md section 19 at batch 1 on the EPYC Zen 4: the 1x2 in use timed at
    0.7x its seed over a full window, 1x1 at two probe samples taken in a slow second (1.2x). Read
    alone, 1x1 (9.4 ms) looked dearer than 1x2 (7.3 ms) and the goodput model kept the larger tree."""
    live = LiveStepCosts(ORDERED_SEED, window=16)
    for _ in range(16):
        live.observe(1, (1, 2), 0.7 * 0.0104)
    for _ in range(2):
        live.observe(1, (1, 1), 1.2 * 0.008)
    assert live.own_ratio(1, (1, 1)) == pytest.approx(1.2)
    assert live.ratio(1, (1, 1)) == pytest.approx(0.7)  # held at the better-sampled larger tree's
    assert live.t_spec(1, (1, 1)) < live.t_spec(1, (1, 2))
    taus = ORDERED_SEED.tokens_per_step
    assert best_choice(live, 1, taus).shape == (1, 1)
    # a larger tree with fewer samples is held from below: 2x2 probed in a fast second (0.5x)
    for _ in range(2):
        live.observe(1, (2, 2), 0.5 * 0.0112)
    assert live.ratio(1, (2, 2)) == pytest.approx(0.7)
    # the better-sampled side keeps its own ratio
    assert live.ratio(1, (1, 2)) == pytest.approx(0.7)


def test_trees_ordered_only_by_better_sampled_peers_and_never_by_merged_ones():
    """A tree bounds only trees it has more samples of; a larger tree whose samples verified fewer rows
    than its shape's own (beams merged) bounds none from above, as its low ratio is its own saving."""
    live = LiveStepCosts(ORDERED_SEED, window=16)
    for _ in range(4):
        live.observe(1, (1, 1), 0.008 * 1.5)
    for _ in range(4):  # as many samples: not better sampled, no bound either way
        live.observe(1, (1, 2), 0.0104 * 0.8)
    assert live.ratio(1, (1, 1)) == pytest.approx(1.5) and live.ratio(1, (1, 2)) == pytest.approx(0.8)
    merged = LiveStepCosts(ORDERED_SEED, window=16)
    for _ in range(16):  # 2x2 trees whose beams merged to 3 rows
        merged.observe(1, (2, 2), 0.006, rows=3)
    merged.observe(1, (1, 1), 0.008)
    assert merged.ratio(1, (1, 1)) == pytest.approx(1.0)


def test_a_read_follows_every_sample_and_context_change():
    """Reads are kept per (bucket, choice) between changes (a tree's read computes its peers'): a
    new sample, a new context and a reseed each give a fresh read."""
    live = LiveStepCosts(SEED)
    for ctx in (100, 120, 140, 400, 420, 440):
        live.observe(1, (2, 2), 0.020 * (1 + ctx / 400), context=ctx)
    live.at_context(100)
    short = live.t_spec(1, (2, 2))
    assert live.t_spec(1, (2, 2)) == short
    live.at_context(440)
    assert live.t_spec(1, (2, 2)) > short
    live.observe(1, None, 0.010, context=440)
    plain = live.t_plain(1)
    live.observe(1, None, 0.030, context=440)
    live.observe(1, None, 0.030, context=440)
    assert live.t_plain(1) > plain
    live.reseed(SEED)
    assert live.t_spec(1, (2, 2)) == SEED.t_spec(1, (2, 2))
