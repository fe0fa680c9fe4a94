"""Draft trees cut by the drafter's confidence (workers/redrafter/pruning.py): which beams and tokens
are kept, and the threshold a row's cost sets."""

from __future__ import annotations

import math

import pytest

from workers.redrafter.pruning import min_path_prob, prune_beams
from workers.redrafter.tree import build_prefix_tree

BEAMS = [[7, 1, 2, 3], [7, 4, 5, 6]]
PROBS = [[0.9, 0.5, 0.5], [0.3, 0.9, 0.1]]  # path probabilities: 0.9 .45 .225 | 0.3 .27 .027


@pytest.mark.parametrize("min_prob, want", [
    (0.0, BEAMS),
    (0.2, [[7, 1, 2, 3], [7, 4, 5]]),
    (0.28, [[7, 1, 2], [7, 4]]),
    (0.4, [[7, 1, 2]]),
    (0.5, [[7, 1]]),
    (0.95, []),
])
def test_each_beam_is_cut_before_its_first_token_below_the_threshold(min_prob, want):
    assert prune_beams(BEAMS, PROBS, min_prob) == want


def test_a_nan_probability_is_never_confident_and_the_kept_beams_form_a_prefix_tree():
    assert prune_beams([[3, 8, 9], [3, 8, 10]], [[math.nan, 1.0], [0.6, math.nan]], 0.01) == [[3, 8]]
    kept = prune_beams(BEAMS, PROBS, 0.25)
    tree = build_prefix_tree(kept)
    assert tree.num_nodes == 1 + sum(len(b) - 1 for b in kept)  # distinct first tokens: nothing shared
    assert all(prefix in [b[:k] for b in BEAMS for k in range(len(b) + 1)] for prefix in kept)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="min_prob"):
        prune_beams(BEAMS, PROBS, 1.5)
    with pytest.raises(ValueError, match="2 beams but probabilities for 1"):
        prune_beams(BEAMS, PROBS[:1], 0.1)
    with pytest.raises(ValueError, match="row_s"):
        min_path_prob(-1.0, 100.0)
    with pytest.raises(ValueError, match="rate"):
        min_path_prob(0.001, math.inf)


def test_a_row_pays_when_its_expected_tokens_beat_the_iterations_rate():
    # 250 tokens/s and a row of 0.8 ms: a node must bring 0.2 tokens
    assert min_path_prob(0.0008, 250.0) == pytest.approx(0.2)
    assert min_path_prob(0.0008, 250.0, scale=0.5) == pytest.approx(0.1)
    assert min_path_prob(0.01, 250.0) == 1.0  # rows dearer than any token: nothing drafted is kept
    assert min_path_prob(0.0, 250.0) == 0.0
