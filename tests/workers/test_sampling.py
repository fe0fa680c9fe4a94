import math
import random

import pytest
import torch
from scipy.stats import chisquare, kstest, pearsonr

from workers.sampling import SamplingParams, adjusted_probs, greedy_tokens, keyed_uniform, sample_keyed


def _softmax(values: list[float]) -> list[float]:
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


def test_greedy_is_one_hot_at_lowest_argmax():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 5.0]])
    probs = adjusted_probs(logits, SamplingParams(temperature=0.0))
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_temperature_scales_logits():
    logits = [1.0, 2.0, 0.5, -1.0]
    probs = adjusted_probs(torch.tensor([logits]), SamplingParams(temperature=0.5))
    expected = _softmax([v / 0.5 for v in logits])
    assert probs[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_top_k_keeps_k_largest():
    logits = [1.0, 4.0, 2.0, 3.0, 0.0]
    probs = adjusted_probs(torch.tensor([logits]), SamplingParams(temperature=1.0, top_k=2))
    kept = _softmax([4.0, 3.0])
    assert probs[0].tolist() == pytest.approx([0.0, kept[0], 0.0, kept[1], 0.0], abs=1e-6)


def test_top_k_ties_keep_lowest_ids():
    probs = adjusted_probs(torch.tensor([[1.0, 2.0, 2.0, 2.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert probs[0].tolist() == pytest.approx([0.0, 0.5, 0.5, 0.0], abs=1e-6)


def test_top_p_keeps_smallest_nucleus():
    probs_in = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    logits = probs_in.log()
    # Sorted: 0.5, 0.25, 0.15, 0.1; cumulative 0.5, 0.75, 0.9 -> top_p 0.7 keeps {1, 3}.
    probs = adjusted_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert probs[0].tolist() == pytest.approx([0.0, 0.5 / 0.75, 0.0, 0.25 / 0.75], abs=1e-6)
    # 0.76 is not reached by {1, 3} (0.75), so token 2 joins the nucleus.
    probs = adjusted_probs(logits, SamplingParams(temperature=1.0, top_p=0.76))
    assert probs[0].tolist() == pytest.approx([0.0, 0.5 / 0.9, 0.15 / 0.9, 0.25 / 0.9], abs=1e-6)


def test_top_p_always_keeps_one_token():
    logits = torch.tensor([[0.0, 1.0, 0.5]])
    probs = adjusted_probs(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    assert probs[0].tolist() == [0.0, 1.0, 0.0]


def test_top_k_then_top_p_on_renormalised_mass():
    probs_in = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # top_k 3 -> [0.4, 0.3, 0.2] / 0.9; cumulative 0.444, 0.778 -> top_p 0.7 keeps tokens 0 and 1.
    probs = adjusted_probs(probs_in.log(), SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    assert probs[0].tolist() == pytest.approx([4 / 7, 3 / 7, 0.0, 0.0], abs=1e-6)


def test_rows_are_independent_and_normalised():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    probs = adjusted_probs(logits, SamplingParams(temperature=0.7, top_k=20, top_p=0.8))
    assert probs.shape == (5, 100)
    assert torch.allclose(probs.sum(-1), torch.ones(5))
    assert ((probs > 0).sum(-1) <= 20).all()
    for row in range(5):
        single = adjusted_probs(logits[row : row + 1], SamplingParams(temperature=0.7, top_k=20, top_p=0.8))
        assert torch.allclose(single[0], probs[row])


def test_sample_keyed_is_the_inverse_cdf_and_respects_support():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]] * 5 + [[0.0, 0.0, 0.0, 1.0]] * 2)
    draws = [0.0, 0.25, 0.4999, 0.5, 0.9999999, 0.0, 0.9999999]
    assert sample_keyed(probs, draws) == [1, 1, 1, 2, 2, 3, 3]


def test_sample_keyed_draws_follow_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    rng = random.Random(1)
    tokens = sample_keyed(probs.repeat(20_000, 1), [rng.random() for _ in range(20_000)])
    counts = [tokens.count(t) for t in range(4)]
    assert counts[1] == 0
    assert chisquare([counts[0], counts[2], counts[3]], [2_000, 12_000, 6_000]).pvalue > 1e-4


def test_keyed_uniform_depends_only_on_seed_and_position():
    draws = [keyed_uniform(7, p) for p in range(20_000)]
    assert draws == [keyed_uniform(7, p) for p in range(20_000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert kstest(draws, "uniform").pvalue > 1e-4
    assert keyed_uniform(8, 0) != keyed_uniform(7, 0) and keyed_uniform(7, 1) != keyed_uniform(7, 0)
    # seeds are taken modulo 2^64: the API's range (-2^63 .. 2^64 - 1) all works
    assert keyed_uniform(-1, 3) == keyed_uniform(2**64 - 1, 3)
    # neighbouring seeds give unrelated draws
    assert abs(pearsonr(draws[:2000], [keyed_uniform(8, p) for p in range(2000)])[0]) < 0.1


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40, 1e-8])
def test_tiny_temperatures_give_a_distribution_not_nan(temperature):
    """A temperature below float32's range (the API accepts any value in [0, 2]) must not round to
    0 and divide 0 by 0: it samples (almost surely) the argmax."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0 - 1e-3]])
    probs = adjusted_probs(logits, SamplingParams(temperature=temperature))
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(1))
    assert int(probs.argmax()) == 1 and float(probs[0, 1]) > 0.99


@pytest.mark.parametrize("row", [[float("nan"), 0.5, 0.5], [float("inf"), 0.0, 0.0], [-0.1, 0.6, 0.5], [0.0, 0.0, 0.0]])
def test_sample_keyed_refuses_what_is_not_a_distribution(row):
    """As torch.multinomial did: NaN logits (an overflow) must fail the request, not emit a token."""
    with pytest.raises(RuntimeError, match="probability tensor"):
        sample_keyed(torch.tensor([row]), [0.5])


def test_greedy_tokens_are_torch_argmax_with_ties_and_nan():
    """The faster max(dim).indices picks what argmax picks: the first maximum, NaN as the maximum."""
    torch.manual_seed(3)
    x = torch.randn(40, 49152)
    x[3, 10] = x[3, 20] = x[3].max() + 1  # a tie: the lower index
    x[4, 7] = float("nan")
    x[5] = 0.0  # every column ties
    x[6, -1] = float("inf")
    got = greedy_tokens(x)
    assert got.dtype == torch.long and torch.equal(got, x.argmax(-1))
    assert got[3] == 10 and got[4] == 7 and got[5] == 0 and got[6] == 49151
