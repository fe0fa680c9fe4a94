"""The ReDrafter head: export of a ``shared`` head to Apple's layout, and beam search.

Beam search is checked against brute-force enumeration of every draft sequence on a tiny vocabulary
(ReDrafter arXiv 2403.09919 Sec. 3.2: beams are scored by the sum of draft log-probabilities).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from workers.redrafter.beam_search import draft_beams_batch
from workers.redrafter.drafter import DrafterConfig, ReDrafter, load_drafter


def draft_beams(drafter: ReDrafter, embed, context: torch.Tensor, root: int, num_beams: int,
                draft_len: int) -> torch.Tensor:
    """Beams for one sequence (``context [H]``): ``draft_beams_batch`` with a batch of one;
    ``[num_beams, draft_len + 1] long``, column 0 is ``root``."""
    roots = torch.tensor([root], device=context.device)
    return draft_beams_batch(drafter, embed, context[None], roots, num_beams, draft_len)[0]


def random_drafter(vocab: int, hidden: int, layers: int, head_type: str, seed: int = 0, std: float = 0.5):
    """``(drafter, base_lm_head [V, H], embedding)`` with random weights of standard deviation ``std``."""
    gen = torch.Generator().manual_seed(seed)
    lm_head = torch.randn(vocab, hidden, generator=gen) * std
    embed = torch.nn.Embedding(vocab, hidden)
    torch.manual_seed(seed)
    drafter = ReDrafter(DrafterConfig(vocab, hidden, layers, head_type), lm_head if head_type == "shared" else None)
    with torch.no_grad():
        for p in [*drafter.parameters(), embed.weight]:
            p.normal_(0, std)
    return drafter.eval(), lm_head, embed


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_apple_layout_export_loads_with_equal_logits(tmp_path, layers):
    drafter, lm_head, _ = random_drafter(vocab=50, hidden=16, layers=layers, head_type="shared", std=0.2)
    state = drafter.export_apple_state_dict()
    expected = {"rnn_u.weight", "rnn_u.bias", "rnn_w.weight", f"lm_head.{layers}.weight"}
    expected |= {f"lm_head.{i}.linear.{p}" for i in range(layers) for p in ("weight", "bias")}
    assert set(state) == expected
    assert state[f"lm_head.{layers}.weight"].shape == (50, 32)

    drafter.save(tmp_path / "apple", apple_layout=True)
    drafter.save(tmp_path / "ours")
    apple = load_drafter(tmp_path / "apple", lm_head)
    ours = load_drafter(tmp_path / "ours", lm_head)
    assert apple.config.head_type == "full" and ours.config.head_type == "shared"
    gen = torch.Generator().manual_seed(1)
    context, state_in = torch.randn(64, 16, generator=gen), torch.randn(64, 16, generator=gen)
    tokens = torch.randn(64, 16, generator=gen)
    with torch.no_grad():
        want = drafter.logits(context, drafter.step_state(state_in, tokens))
        for loaded in (apple, ours):
            got = loaded.logits(context, loaded.step_state(state_in, tokens))
            assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert want.std() > 0.3  # logits are not flat, so the comparison means something


def test_load_rejects_mismatched_base_model(tmp_path):
    drafter, _, _ = random_drafter(vocab=50, hidden=16, layers=2, head_type="shared")
    drafter.save(tmp_path / "d")
    with pytest.raises(ValueError):
        load_drafter(tmp_path / "d", torch.zeros(51, 16))


def sequence_score(drafter: ReDrafter, embed, context: torch.Tensor, root: int, seq: tuple[int, ...]) -> float:
    """Sum of draft log-probabilities of ``seq`` after ``root`` (the quantity beam search ranks)."""
    state = torch.zeros(1, context.shape[-1])
    prev, total = root, 0.0
    for token in seq:
        state = drafter.step_state(state, embed(torch.tensor([prev])))
        total += float(torch.log_softmax(drafter.logits(context[None], state), -1)[0, token])
        prev = token
    return total


def check_exhaustive(head_type: str, seed: int, vocab: int, draft_len: int) -> None:
    """With ``num_beams = vocab ** (draft_len - 1)`` beam search keeps every prefix, so its beams
    are exactly the ``num_beams`` best sequences of all ``vocab ** draft_len``, best first."""
    root = 2
    drafter, _, embed = random_drafter(vocab=vocab, hidden=8, layers=2, head_type=head_type, seed=seed)
    context = torch.randn(8, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        scores = {seq: sequence_score(drafter, embed, context, root, seq)
                  for seq in itertools.product(range(vocab), repeat=draft_len)}
        num_beams = vocab ** (draft_len - 1)
        beams = draft_beams(drafter, embed, context, root, num_beams, draft_len)
    assert beams.shape == (num_beams, draft_len + 1)
    assert (beams[:, 0] == root).all()
    rows = [tuple(r[1:]) for r in beams.tolist()]
    assert rows[0] == max(scores, key=scores.get)
    assert rows == sorted(scores, key=scores.get, reverse=True)[:num_beams]


@pytest.mark.parametrize("head_type", ["shared", "full"])
@pytest.mark.parametrize("seed", range(4))
def test_exhaustive_beam_search_two_draft_tokens(head_type, seed):
    check_exhaustive(head_type, seed, vocab=5, draft_len=2)


@pytest.mark.parametrize("head_type", ["shared", "full"])
def test_exhaustive_beam_search_three_draft_tokens(head_type):
    check_exhaustive(head_type, 0, vocab=5, draft_len=3)


@pytest.mark.parametrize("num_beams, draft_len", [(1, 1), (3, 4), (8, 2), (4, 6)])
def test_beam_shapes_root_and_distinct_beams(num_beams, draft_len):
    vocab = 30
    drafter, _, embed = random_drafter(vocab=vocab, hidden=8, layers=2, head_type="shared", seed=5)
    context = torch.randn(8, generator=torch.Generator().manual_seed(6))
    beams = draft_beams(drafter, embed, context, 7, num_beams, draft_len)
    assert beams.shape == (num_beams, draft_len + 1) and beams.dtype == torch.long
    assert (beams[:, 0] == 7).all()
    assert len({tuple(r) for r in beams.tolist()}) == num_beams
    with torch.no_grad():
        scores = [sequence_score(drafter, embed, context, 7, tuple(r[1:])) for r in beams.tolist()]
    assert all(a >= b - 1e-5 for a, b in zip(scores, scores[1:])), "beams not ordered by score"


@pytest.mark.parametrize("num_beams,draft_len", [(1, 1), (3, 2), (4, 3)])
def test_batched_beam_search_equals_one_sequence_at_a_time(num_beams, draft_len):
    """In-flight batching drafts every generation request in one call; each row must be exactly
    the beams that sequence gets alone."""
    drafter, _, embed = random_drafter(vocab=11, hidden=8, layers=2, head_type="shared", seed=3)
    context = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    roots = torch.tensor([2, 7, 2, 0, 10])
    with torch.no_grad():
        batched = draft_beams_batch(drafter, embed, context, roots, num_beams, draft_len)
        for b in range(5):
            assert torch.equal(batched[b], draft_beams(drafter, embed, context[b], int(roots[b]), num_beams, draft_len))


@pytest.mark.parametrize("head_type", ["shared", "full"])
def test_distinct_first_beams_start_with_the_top_tokens_and_continue_greedily(head_type):
    """Beam ``j`` starts with the j-th most likely first token; each later token is the drafter's
    argmax after the beam so far (checked one sequence at a time against the drafter's logits);
    with one beam it is beam search's beam."""
    from workers.redrafter.beam_search import draft_distinct_first_batch

    drafter, _, embed = random_drafter(vocab=13, hidden=8, layers=2, head_type=head_type, seed=4)
    context = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    roots = torch.tensor([1, 5, 12])
    with torch.no_grad():
        beams = draft_distinct_first_batch(drafter, embed, context, roots, 4, 3)
        assert beams.shape == (3, 4, 4) and (beams[:, :, 0] == roots[:, None]).all()
        for b in range(3):
            first = drafter.logits(context[b][None], drafter.first_state(embed(roots[b : b + 1])))[0]
            assert beams[b, :, 1].tolist() == first.topk(4).indices.tolist()  # distinct, best first
            for beam in beams[b]:
                state = torch.zeros(1, 8)
                for k in range(1, 4):  # the state after beam[:k] predicts beam[k]; from k = 2 on, its argmax
                    state = drafter.step_state(state, embed(beam[k - 1 : k]))
                    if k >= 2:
                        assert int(drafter.logits(context[b][None], state).argmax()) == int(beam[k])
        one = draft_distinct_first_batch(drafter, embed, context, roots, 1, 3)
        assert torch.equal(one, draft_beams_batch(drafter, embed, context, roots, 1, 3))
