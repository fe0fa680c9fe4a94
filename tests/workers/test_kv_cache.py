"""KV cache rewind after draft-tree verification (ReDrafter arXiv 2403.09919 Sec. 3.3).

After a speculative step the committed slots must hold exactly the keys/values plain decoding of the
same tokens writes, and the stale scratch slots after them must not influence later steps.
"""

from __future__ import annotations

import random

import torch

from workers.executor import LocalExecutor
from workers.forward_batch import AttentionGroup, contiguous_batch
from workers.kv_cache import KVCache
from workers.models.loader import load_model
from workers.redrafter.beam_search import draft_beams
from workers.redrafter.drafter import load_drafter
from workers.sampling import SamplingParams
from workers.speculative_step import plain_step, speculative_step

GREEDY = SamplingParams(temperature=0.0)


def test_copy_slots_moves_entries_in_every_layer():
    cache = KVCache(num_layers=2, num_slots=12, n_kv_heads=1, head_dim=3)
    for layer in range(2):
        cache.k[layer].copy_(torch.randn(13, 1, 3))
        cache.v[layer].copy_(torch.randn(13, 1, 3))
    before = [t.clone() for t in cache.k + cache.v]
    cache.copy_slots(torch.tensor([4, 6, 9]), torch.tensor([4, 5, 6]))
    for new, old in zip(cache.k + cache.v, before):
        assert torch.equal(new[4:7], old[[4, 6, 9]])
        assert torch.equal(new[:4], old[:4]) and torch.equal(new[7:], old[7:])


def test_read_gathers_block_table_slots_and_views_runs():
    cache = KVCache(num_layers=1, num_slots=16, n_kv_heads=2, head_dim=3)
    cache.k[0].copy_(torch.randn(17, 2, 3))
    cache.v[0].copy_(torch.randn(17, 2, 3))
    slots = torch.tensor([[8, 9, 2, 3], [0, 1, 2, 3]])
    group = AttentionGroup(0, 2, 1, slots, torch.ones(2, 1, 1, 4, dtype=torch.bool))
    k, v = cache.read(0, group)
    assert k.shape == (2, 2, 4, 3)
    assert torch.equal(k[0], cache.k[0][[8, 9, 2, 3]].transpose(0, 1))
    assert torch.equal(v[1], cache.v[0][:4].transpose(0, 1))
    run = AttentionGroup(0, 1, 1, torch.arange(5, 9)[None], torch.ones(1, 1, 1, 4, dtype=torch.bool), 5)
    k, _ = cache.read(0, run)
    assert torch.equal(k[0], cache.k[0][5:9].transpose(0, 1))


class ContiguousRow:
    """A single sequence in slots 0.. of an executor's cache, prefilled token by token."""

    def __init__(self, model, num_slots: int = 200):
        self.executor = LocalExecutor(model, num_slots)
        self.length = 0

    def prefill(self, ids: list[int]) -> torch.Tensor:
        hidden = self.executor.forward(contiguous_batch(torch.tensor(ids), self.length))
        self.length += len(ids)
        return hidden


@torch.inference_mode()
def test_committed_slots_equal_plain_decoding(tiny_model_dirs, trained_drafter_dirs):
    model = load_model(tiny_model_dirs["tied_gqa2"])
    drafter = load_drafter(trained_drafter_dirs["tied_gqa2"], model.lm_head.weight)
    rng = random.Random(0)
    moved_paths = accepted_total = 0
    for _ in range(4):
        prompt = [rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(2, 30))]
        spec, plain = ContiguousRow(model), ContiguousRow(model)
        copies = []
        copy = spec.executor.copy_slots
        spec.executor.copy_slots = lambda src, dst: (copies.append(src.tolist()), copy(src, dst))
        hidden = spec.prefill(prompt)[-1]
        plain.prefill(prompt)
        root = int(model.logits(hidden).argmax())
        emitted = []
        for _ in range(8):
            beams = draft_beams(drafter, model.model.embed_tokens, hidden, root, 4, 4)
            tokens, hidden = speculative_step(spec.executor, spec.length, beams, GREEDY, None)
            spec.length += len(tokens)
            for token in [root, *tokens[:-1]]:  # the bonus token is not in the cache yet
                plain_hidden = plain.prefill([token])[-1]
            L = spec.length
            assert plain.length == L
            for layer in range(model.config.num_hidden_layers):
                for a, b in ((spec.executor.cache.k, plain.executor.cache.k), (spec.executor.cache.v, plain.executor.cache.v)):
                    assert torch.allclose(a[layer][:L], b[layer][:L], atol=1e-5)
            assert torch.allclose(hidden, plain_hidden, atol=1e-5)
            accepted_total += len(tokens) - 1
            emitted += tokens
            root = tokens[-1]
        moved_paths += len(copies)
        # Stale scratch slots after the committed prefix do not leak into the next plain step.
        spec_next, _ = plain_step(spec.executor, spec.length, root, GREEDY, None)
        plain_next, _ = plain_step(plain.executor, plain.length, root, GREEDY, None)
        assert spec_next == plain_next
    assert accepted_total >= 20, "few drafts accepted: the comparison covers little"
    assert moved_paths >= 1, "no accepted path needed moving: copy_slots was not exercised"
