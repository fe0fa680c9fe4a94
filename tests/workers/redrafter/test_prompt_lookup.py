import random

import pytest

from workers.redrafter.prompt_lookup import NgramIndex, PromptLookup


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition: the longest suffix (max_n down to min_n) with an earlier occurrence that has
    a follower; continue from its latest such occurrence, periodically past the end."""
    L = len(tokens)
    for n in range(min(max_n, L), min_n - 1, -1):
        suffix = tokens[L - n:]
        ends = [e for e in range(n - 1, L - 1) if tokens[e - n + 1: e + 1] == suffix]
        if ends:
            seq = list(tokens)
            for j in range(1, k + 1):
                seq.append(seq[ends[-1] + j])
            return seq[L:]
    return []


def test_continues_the_latest_occurrence_of_the_longest_suffix():
    index = NgramIndex(1, 3)
    #          0  1  2  3  4  5  6  7  8  9
    index.sync([5, 6, 7, 8, 9, 6, 7, 1, 5, 6, 7])
    # suffix (5, 6, 7) occurs at 0..2 (followed by 8, 9); the 2-gram (6, 7) last occurred at 5..6 (-> 1)
    assert index.propose(3) == [8, 9, 6]
    index = NgramIndex(1, 2)
    index.sync([5, 6, 7, 8, 9, 6, 7, 1, 5, 6, 7])
    assert index.propose(2) == [1, 5]


def test_no_match_gives_nothing_and_min_n_is_respected():
    index = NgramIndex(2, 3)
    index.sync([1, 2, 3, 4, 2])  # only the 1-gram (2) occurred before
    assert index.propose(4) == []
    index = NgramIndex(1, 3)
    index.sync([1, 2, 3, 4, 2])
    assert index.propose(4) == [3, 4, 2, 3]
    assert NgramIndex(1, 3).propose(2) == []


def test_a_repeated_phrase_continues_periodically():
    index = NgramIndex(2, 3)
    index.sync([9, 1, 2, 1, 2])  # (1, 2) ended at index 2 -> 1, 2, 1, 2, ...
    assert index.propose(5) == [1, 2, 1, 2, 1]
    index = NgramIndex(1, 1)
    index.sync([3, 3])
    assert index.propose(4) == [3, 3, 3, 3]


@pytest.mark.parametrize("seed", range(30))
def test_incremental_sync_matches_the_definition(seed):
    rng = random.Random(seed)
    min_n = rng.randint(1, 3)
    max_n = rng.randint(min_n, 4)
    vocab = rng.randint(2, 6)
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
    index = NgramIndex(min_n, max_n)
    for _ in range(25):
        cut = rng.randint(0, len(tokens))  # the engine passes prompt and output separately
        index.sync(tokens[:cut], tokens[cut:])
        k = rng.randint(1, 6)
        assert index.propose(k) == brute_force(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)
        tokens = tokens + [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]


def test_a_context_that_shrinks_is_an_error():
    index = NgramIndex(1, 2)
    index.sync([1, 2, 3])
    with pytest.raises(ValueError, match="shrank"):
        index.sync([1, 2])


def test_the_beam_doubles_after_a_whole_beam_was_accepted_and_resets_otherwise():
    grow = PromptLookup(2, 3, 4, max_num_tokens=12)
    assert (grow.longest, grow.next_length(4, True), grow.next_length(8, True), grow.next_length(12, True)) == (12, 8, 12, 12)
    assert grow.next_length(8, False) == 4
    fixed = PromptLookup(2, 3, 4)
    assert (fixed.longest, fixed.next_length(4, True), fixed.next_length(4, False)) == (4, 4, 4)


@pytest.mark.parametrize("args", [(0, 2, 3), (3, 2, 3), (1, 2, 0), (1, 2, 4, 3)])
def test_bad_settings_are_errors(args):
    with pytest.raises(ValueError, match="prompt_lookup"):
        PromptLookup(*args)
