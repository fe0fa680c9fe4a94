"""Tensor-parallel executor on real MPI ranks (spawned through MPICH): TP2, TP4 and TP8 agree with
the unsharded model (TP1, :class:`~workers.executor.LocalExecutor`).

The model has 8 query heads and 4 KV heads, so TP2 and TP4 split the KV heads and TP8 replicates
them (two ranks per KV head); its vocabulary (397, prime) pads the last vocab slice at every
``tp_size``. Executors are spawned once per module (TP8 runs oversubscribed on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

from tp_models import make_tp_model_dir
from tiny_model import make_tiny_drafter_dir
from workers.executor import LocalExecutor
from workers.forward_batch import AttentionGroup, ForwardBatch, contiguous_batch
from workers.models.loader import load_model
from workers.redrafter.acceptance import accept_greedy
from workers.redrafter.beam_search import draft_beams_batch
from workers.redrafter.drafter import load_drafter
from workers.redrafter.tree import build_prefix_tree
from workers.tp.executor import TPExecutor

TP_SIZES = (2, 4, 8)
NUM_SLOTS = 256
ATOL = 3e-5  # float32; all-reduce changes the summation order


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tp_model_dir(tmp_path_factory.mktemp("tp") / "h8_kv4", heads=8, kv_heads=4)


@pytest.fixture(scope="module")
def executors(model_dir):
    """``{tp_size: executor}``; 1 is the unsharded reference."""
    exs = {1: LocalExecutor(load_model(model_dir), NUM_SLOTS)}
    try:
        for tp in TP_SIZES:
            exs[tp] = TPExecutor(str(model_dir), tp, NUM_SLOTS, num_threads=1)
        yield exs
    finally:
        for ex in exs.values():
            ex.close()


def _group(start: int, kv_slots: list[list[int]], mask: torch.Tensor) -> AttentionGroup:
    return AttentionGroup(start, mask.shape[0], mask.shape[2], torch.tensor(kv_slots), mask)


def _mixed_iterations(trash: int) -> list[tuple[ForwardBatch, tuple[list[int], list[int]] | None]]:
    """Three iterations of four requests, each ``(batch, KV copy after it or None)``.

    1: context chunks of A (7 tokens, slots 0..), B (6, slots 100..), C (4, slots 150..) and D (3,
       slots 200..), one group each.
    2: A's second context chunk (5 tokens, causal over its 12), B's draft tree (tree attention,
       positions 6 + depth), C and D decoding one token each in one padded group of batch 2.
    3: after compacting B's accepted path (nodes 0, 2, 5 -> slots 106..108), B decodes one token
       reading the compacted slots, batched with A's next token.
    """
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(3, 397, (n,), generator=g)

    def causal(n, prefix=0):
        m = torch.ones(n, prefix + n, dtype=torch.bool)
        m[:, prefix:] = torch.ones(n, n, dtype=torch.bool).tril()
        return m[None, None]

    lens = {"A": 7, "B": 6, "C": 4, "D": 3}
    base = {"A": 0, "B": 100, "C": 150, "D": 200}
    it1_ids, it1_pos, it1_slots, groups, start = [], [], [], [], 0
    for r, n in lens.items():
        it1_ids.append(ids(n))
        it1_pos.append(torch.arange(n))
        it1_slots.append(torch.arange(base[r], base[r] + n))
        groups.append(_group(start, [list(range(base[r], base[r] + n))], causal(n)))
        start += n
    it1 = ForwardBatch(torch.cat(it1_ids), torch.cat(it1_pos), torch.cat(it1_slots), groups)

    beams = torch.tensor([[7, 11, 12, 13], [7, 11, 14, 15], [7, 16, 17, 18]])
    tree = build_prefix_tree(beams)
    n_tree = tree.tokens.numel()
    tree_mask = torch.ones(n_tree, 6 + n_tree, dtype=torch.bool)
    tree_mask[:, 6:] = tree.mask
    cd_mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    cd_mask[1, 0, 0, 4] = False  # D reads 4 slots; its row is padded with the trash slot
    it2 = ForwardBatch(
        torch.cat([ids(5), tree.tokens, ids(2)]),
        torch.cat([torch.arange(7, 12), 6 + tree.depths, torch.tensor([4, 3])]),
        torch.cat([torch.arange(7, 12), torch.arange(106, 106 + n_tree), torch.tensor([154, 203])]),
        [
            _group(0, [list(range(0, 12))], causal(5, 7)),
            _group(5, [list(range(100, 106 + n_tree))], tree_mask[None, None]),
            _group(5 + n_tree, [list(range(150, 155)), list(range(200, 204)) + [trash]], cd_mask),
        ],
    )
    path = [0, 2, 5]  # root, beam 1's first and second tokens: not contiguous in the packed tree
    copy = ([106 + p for p in path], [106 + i for i in range(len(path))])
    it3 = ForwardBatch(
        ids(2), torch.tensor([12, 9]), torch.tensor([12, 109]),
        [_group(0, [list(range(0, 13))], torch.ones(1, 1, 1, 13, dtype=torch.bool)),
         _group(1, [list(range(100, 110))], torch.ones(1, 1, 1, 10, dtype=torch.bool))],
    )
    return [(it1, None), (it2, copy), (it3, None)]


def _run_iterations(ex) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for batch, copy in _mixed_iterations(ex.trash_slot):
        hidden = ex.forward(batch)
        out.append((hidden, ex.logits(hidden)))
        if copy is not None:
            ex.copy_slots(torch.tensor(copy[0]), torch.tensor(copy[1]))
    return out


@pytest.mark.parametrize("tp", TP_SIZES)
def test_mixed_batches_match_unsharded(executors, tp):
    """Context chunks, a draft tree, a padded generation group and KV compaction: hidden states and
    logits equal TP1's."""
    ref, got = _run_iterations(executors[1]), _run_iterations(executors[tp])
    for (h_ref, l_ref), (h, l) in zip(ref, got):
        assert l.shape == l_ref.shape == (h_ref.shape[0], 397) and l.dtype == torch.float32
        torch.testing.assert_close(h, h_ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(l, l_ref, atol=ATOL, rtol=0)


def _greedy(ex, prompt: list[int], max_new: int, beams_for=None) -> tuple[list[int], int]:
    """Greedy decoding of one sequence over the executor API (slots = positions): each step verifies
    the tree of ``beams_for(ex, out, hidden)`` (``[num_beams, 1 + draft_len]``, column 0 the last
    token), or the last token alone (plain decoding), keeps the longest accepted path plus the bonus
    token and compacts its KV entries. Returns (tokens, accepted draft tokens)."""
    hidden = ex.forward(contiguous_batch(torch.tensor(prompt), 0))[-1]
    out = [int(ex.logits(hidden[None]).argmax())]
    L, accepted = len(prompt), 0
    while len(out) < max_new:
        beams = torch.tensor([[out[-1]]]) if beams_for is None else beams_for(ex, out, hidden)
        tree = build_prefix_tree(beams)
        h = ex.forward(contiguous_batch(tree.tokens, L, tree.mask, L + tree.depths))
        path, bonus = accept_greedy(tree, ex.logits(h).argmax(-1).tolist())
        if path != list(range(len(path))):
            ex.copy_slots(torch.tensor(path) + L, torch.arange(L, L + len(path)))
        tokens = tree.tokens[path[1:]].tolist() + [bonus]
        hidden, accepted, L = h[path[-1]], accepted + len(tokens) - 1, L + len(tokens)
        out += tokens
    return out[:max_new], accepted


PROMPTS = ([5, 17, 42, 99, 3, 250], [300, 12, 7])
MAX_NEW = 24


@pytest.fixture(scope="module")
def plain_reference(executors):
    return [_greedy(executors[1], p, MAX_NEW)[0] for p in PROMPTS]


@pytest.mark.parametrize("tp", TP_SIZES)
def test_greedy_plain_decoding_is_token_identical(executors, plain_reference, tp):
    assert [_greedy(executors[tp], p, MAX_NEW)[0] for p in PROMPTS] == plain_reference


def _oracle_beams(reference: list[int], draft_len: int = 3):
    """Beams whose second beam is the reference continuation, the third shares only its first
    token and the first is wrong: the accepted path skips packed nodes, so KV compaction moves
    entries on every rank."""
    def beams(ex, out, hidden):
        k = len(out)
        right = (reference[k : k + draft_len] + [1] * draft_len)[:draft_len]
        wrong = [(t + 1) % 397 for t in right]
        return torch.tensor([[out[-1]] + wrong, [out[-1]] + right, [out[-1], right[0]] + wrong[1:]])
    return beams


@pytest.mark.parametrize("tp", (1,) + TP_SIZES)
def test_greedy_speculative_decoding_is_token_identical(executors, plain_reference, tp):
    for prompt, ref in zip(PROMPTS, plain_reference):
        tokens, accepted = _greedy(executors[tp], prompt, MAX_NEW, _oracle_beams(ref))
        assert tokens == ref
        assert accepted >= MAX_NEW // 2  # multi-token steps happened


@pytest.fixture(scope="module")
def drafter_dir(model_dir, tmp_path_factory):
    return make_tiny_drafter_dir(model_dir, tmp_path_factory.mktemp("tp") / "drafter")


@pytest.mark.parametrize("tp", TP_SIZES)
def test_drafter_on_the_leader(executors, plain_reference, drafter_dir, tp):
    """The draft head runs on the leader from its full embedding and LM-head copies; greedy
    speculative output equals plain output."""
    ex = executors[tp]
    torch.testing.assert_close(ex.lm_head_weight, executors[1].model.lm_head.weight)
    torch.testing.assert_close(ex.embed(torch.tensor([3, 396])), executors[1].embed(torch.tensor([3, 396])))
    drafter = load_drafter(drafter_dir, ex.lm_head_weight)

    def beams(ex, out, hidden):
        return draft_beams_batch(drafter, ex.embed, hidden[None], torch.tensor([out[-1]], device=hidden.device), 2, 2)[0]

    assert _greedy(ex, PROMPTS[0], MAX_NEW, beams)[0] == plain_reference[0]
