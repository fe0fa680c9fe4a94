"""The distinct-first draft in one C call (workers/kernels/drafter.c, workers/redrafter/fused_draft.py)
proposes what the Python search proposes, on every kernel a drafter runs on, and declines drafters
it cannot run."""

from __future__ import annotations

import pytest
import torch

from workers.kernels import build
from workers.redrafter.beam_search import draft_beams_batch, draft_distinct_first_batch
from workers.redrafter.drafter import DrafterConfig, ReDrafter, pack_for_cpu
from workers.redrafter.fused_draft import draft_distinct_first_fused, fused_table
from workers.redrafter.quantize import quantize_drafter_for_cpu, use_int8_activations_in_drafter

pytestmark = pytest.mark.skipif(not build.available(), reason="needs rdserve's CPU kernels (a C compiler, AVX2)")

VOCAB, HIDDEN = 500, 64


def _drafter(head_type: str, kernels: str, layers: int = 2, seed: int = 0) -> tuple[ReDrafter, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.3
    d = ReDrafter(DrafterConfig(VOCAB, HIDDEN, layers, head_type), lm_head if head_type == "shared" else None).eval()
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    d.requires_grad_(False)
    d.restrict_vocab(torch.randperm(VOCAB, generator=gen)[:160])
    if kernels == "float32":
        pack_for_cpu(d)
    else:
        quantize_drafter_for_cpu(d)
        if kernels == "int8":
            use_int8_activations_in_drafter(d)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    return d, embed


@pytest.mark.parametrize("head_type", ["shared", "full"])
@pytest.mark.parametrize("kernels", ["float32", "q8_0", "int8"])
def test_fused_draft_proposes_what_the_python_search_proposes(head_type, kernels, isa):
    """On every kernel build this CPU runs (``isa``: the int8 layers take the build's int8 kernel)."""
    d, embed = _drafter(head_type, kernels)
    gen = torch.Generator().manual_seed(1)
    for B, beams, depth in [(1, 1, 1), (1, 2, 2), (3, 2, 2), (2, 4, 3), (1, 3, 5), (4, 1, 4)]:
        ctx = torch.randn(B, HIDDEN, generator=gen)
        roots = torch.randint(0, VOCAB, (B,), generator=gen)
        want = draft_distinct_first_batch(d, lambda ids: embed[ids], ctx, roots, beams, depth)
        got = draft_distinct_first_fused(d, embed, ctx, roots, beams, depth)
        assert got is not None and got.dtype == torch.long
        assert torch.equal(got, want), (B, beams, depth)
        assert set(got[:, :, 1:].flatten().tolist()) <= set(d.draft_vocab.tolist())


@pytest.mark.parametrize("kernels", ["float32", "int8"])
def test_fused_draft_gives_the_python_searchs_draft_probabilities(kernels):
    """Each drafted token's probability under the drafter (softmax over the draft vocabulary, given its
    beam's earlier tokens), from C as from the Python search; first-position ones fall with the beam."""
    d, embed = _drafter("shared", kernels, seed=6)
    gen = torch.Generator().manual_seed(7)
    for B, beams, depth in [(1, 1, 1), (2, 3, 2), (3, 2, 4)]:
        ctx = torch.randn(B, HIDDEN, generator=gen)
        roots = torch.randint(0, VOCAB, (B,), generator=gen)
        want_beams, want = draft_distinct_first_batch(d, lambda ids: embed[ids], ctx, roots, beams, depth,
                                                      with_probs=True)
        got_beams, got = draft_distinct_first_fused(d, embed, ctx, roots, beams, depth, with_probs=True)
        assert torch.equal(got_beams, want_beams)
        assert got.shape == (B, beams, depth) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        assert ((got > 0) & (got <= 1)).all()
        assert (got[:, :-1, 0] >= got[:, 1:, 0]).all()
    # a softmax's: over a draft vocabulary of 3 tokens, the 3 first-position beams' probabilities sum to 1
    d, embed = _drafter("shared", "q8_0", layers=1)
    d.restrict_vocab(torch.tensor([5, 9, 11]))
    quantize_drafter_for_cpu(d)  # the new draft head on the kernels too
    _, p = draft_distinct_first_fused(d, embed, torch.randn(2, HIDDEN), torch.tensor([3, 4]), 8, 1, with_probs=True)
    assert p.shape == (2, 3, 1)
    torch.testing.assert_close(p.sum(dim=1), torch.ones(2, 1), rtol=0, atol=1e-5)


def test_a_nan_logit_gives_nan_probabilities_from_c_as_from_python():
    """A NaN in the logits (here: in a later position's embedding row) makes that position's
    probability NaN on both paths, so pruning cuts the beam there rather than keeping it."""
    d, embed = _drafter("shared", "float32", seed=6)
    ctx, roots = torch.randn(2, HIDDEN), torch.tensor([3, 4])
    first = draft_distinct_first_fused(d, embed, ctx, roots, 2, 3)
    embed = embed.clone()
    embed[first[0, 0, 1]] = float("nan")  # the state after beam 0's first token: NaN from depth 2 on
    want_beams, want = draft_distinct_first_batch(d, lambda ids: embed[ids], ctx, roots, 2, 3, with_probs=True)
    got_beams, got = draft_distinct_first_fused(d, embed, ctx, roots, 2, 3, with_probs=True)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got[0, 0, 1:]).all()
    finite = ~torch.isnan(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-6)
    assert torch.equal(got_beams[:, :, :2], want_beams[:, :, :2])


def test_with_one_beam_or_one_draft_token_it_is_redrafters_beam_search():
    d, embed = _drafter("shared", "int8", seed=3)
    gen = torch.Generator().manual_seed(2)
    for beams, depth in [(1, 4), (3, 1)]:
        ctx, roots = torch.randn(2, HIDDEN, generator=gen), torch.randint(0, VOCAB, (2,), generator=gen)
        want = draft_beams_batch(d, lambda ids: embed[ids], ctx, roots, beams, depth)
        assert torch.equal(draft_distinct_first_fused(d, embed, ctx, roots, beams, depth), want)


def test_more_beams_than_draft_tokens_gives_every_draft_token_once():
    d, embed = _drafter("shared", "q8_0", layers=1)
    d.restrict_vocab(torch.tensor([5, 9, 11]))
    quantize_drafter_for_cpu(d)  # the new draft head on the kernels too
    got = draft_distinct_first_fused(d, embed, torch.randn(1, HIDDEN), torch.tensor([7]), 8, 2)
    assert got.shape == (1, 3, 3)
    assert sorted(got[0, :, 1].tolist()) == [5, 9, 11] and (got[0, :, 0] == 7).all()


def test_a_weight_replaced_after_the_first_call_is_read_fresh():
    d, embed = _drafter("shared", "int8", seed=4)
    ctx, roots = torch.randn(1, HIDDEN), torch.tensor([3])
    draft_distinct_first_fused(d, embed, ctx, roots, 2, 2)
    other, _ = _drafter("shared", "int8", seed=5)
    d._packed_head = other._packed_head  # a new head: new panels, new pointers
    want = draft_distinct_first_batch(d, lambda ids: embed[ids], ctx, roots, 2, 2)
    assert torch.equal(draft_distinct_first_fused(d, embed, ctx, roots, 2, 2), want)


def test_declines_what_it_cannot_run():
    d, embed = _drafter("shared", "q8_0")
    assert fused_table(d, embed.to(torch.float64)) is None  # not a float32 table
    assert fused_table(d, embed[:, :32].contiguous()) is None  # wrong width
    plain = ReDrafter(DrafterConfig(VOCAB, HIDDEN, 2, "shared"), torch.randn(VOCAB, HIDDEN)).eval()
    plain.restrict_vocab(torch.arange(100))
    assert draft_distinct_first_fused(plain, embed, torch.randn(1, HIDDEN), torch.tensor([1]), 2, 2) is None  # torch layers
    d.restrict_vocab(None)  # the full shared head is a plain tensor
    assert draft_distinct_first_fused(d, embed, torch.randn(1, HIDDEN), torch.tensor([1]), 2, 2) is None


def test_rejects_bad_arguments():
    d, embed = _drafter("shared", "q8_0")
    with pytest.raises(ValueError, match="num_beams"):
        draft_distinct_first_fused(d, embed, torch.randn(1, HIDDEN), torch.tensor([1]), 0, 2)
    with pytest.raises(ValueError, match="outside the embedding"):
        draft_distinct_first_fused(d, embed, torch.randn(1, HIDDEN), torch.tensor([VOCAB]), 2, 2)
    with pytest.raises(ValueError, match="do not fit"):
        draft_distinct_first_fused(d, embed, torch.randn(2, HIDDEN), torch.tensor([1]), 2, 2)
