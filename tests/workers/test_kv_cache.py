"""KV cache rewind after draft-tree verification (ReDrafter arXiv 2403.09919 Sec. 3.3).

After a speculative step the committed slots must hold exactly the keys/values plain decoding of the
same tokens writes, and the stale scratch slots after them must not influence later steps.
"""

from __future__ import annotations

import random

import pytest
import torch

from workers.kv_cache import AttentionMetadata, KVCache
from workers.models.loader import load_model
from workers.redrafter.beam_search import draft_beams
from workers.redrafter.drafter import load_drafter
from workers.sampling import SamplingParams
from workers.speculative_step import plain_step, speculative_step

GREEDY = SamplingParams(temperature=0.0)


def test_commit_path_moves_nodes_and_sets_length():
    cache = KVCache(num_layers=2, batch=2, n_kv_heads=1, max_len=12, head_dim=3)
    for layer in range(2):
        cache.k[layer].copy_(torch.randn(2, 12, 1, 3))
        cache.v[layer].copy_(torch.randn(2, 12, 1, 3))
    before_k = [k.clone() for k in cache.k]
    before_v = [v.clone() for v in cache.v]
    cache.commit_path(1, 4, [0, 2, 5])
    assert cache.lengths == [0, 7]
    for layer in range(2):
        for new, old in ((cache.k[layer], before_k[layer]), (cache.v[layer], before_v[layer])):
            assert torch.equal(new[1, 4:7], old[1, [4, 6, 9]])
            assert torch.equal(new[1, :4], old[1, :4])
            assert torch.equal(new[0], old[0])  # other rows untouched
    with pytest.raises(ValueError):
        cache.commit_path(1, 10, [0, 1, 2])


def prefill(model, cache: KVCache, ids: list[int]) -> torch.Tensor:
    T = len(ids)
    L = cache.lengths[0]
    pos = torch.arange(L, L + T)[None]
    mask = torch.ones(1, 1, T, L + T, dtype=torch.bool)
    mask[0, 0, :, L:] = torch.ones(T, T, dtype=torch.bool).tril()
    meta = AttentionMetadata(rows=torch.zeros_like(pos), slots=pos, mask=mask, kv_len=L + T)
    hidden = model(torch.tensor([ids]), pos, cache, meta)[0]
    cache.lengths[0] = L + T
    return hidden


@torch.inference_mode()
def test_committed_slots_equal_plain_decoding(tiny_model_dirs, trained_drafter_dirs):
    model = load_model(tiny_model_dirs["tied_gqa2"])
    drafter = load_drafter(trained_drafter_dirs["tied_gqa2"], model.lm_head.weight)
    rng = random.Random(0)
    moved_paths = accepted_total = 0
    for _ in range(4):
        prompt = [rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(2, 30))]
        spec_cache, plain_cache = model.new_cache(1, 200), model.new_cache(1, 200)
        paths = []
        commit = spec_cache.commit_path
        spec_cache.commit_path = lambda row, start, nodes: (paths.append(list(nodes)), commit(row, start, nodes))
        hidden = prefill(model, spec_cache, prompt)[-1]
        prefill(model, plain_cache, prompt)
        root = int(model.logits(hidden).argmax())
        emitted = []
        for _ in range(8):
            beams = draft_beams(drafter, model.model.embed_tokens, hidden, root, 4, 4)
            tokens, hidden = speculative_step(model, spec_cache, beams, GREEDY, None)
            for token in [root, *tokens[:-1]]:  # the bonus token is not in the cache yet
                plain_hidden = prefill(model, plain_cache, [token])[-1]
            L = spec_cache.lengths[0]
            assert plain_cache.lengths[0] == L
            for layer in range(model.config.num_hidden_layers):
                assert torch.allclose(spec_cache.k[layer][0, :L], plain_cache.k[layer][0, :L], atol=1e-5)
                assert torch.allclose(spec_cache.v[layer][0, :L], plain_cache.v[layer][0, :L], atol=1e-5)
            assert torch.allclose(hidden, plain_hidden, atol=1e-5)
            accepted_total += len(tokens) - 1
            emitted += tokens
            root = tokens[-1]
        moved_paths += sum(p != list(range(len(p))) for p in paths)
        # Stale scratch slots after the committed prefix do not leak into the next plain step.
        spec_next, _ = plain_step(model, spec_cache, root, GREEDY, None)
        plain_next, _ = plain_step(model, plain_cache, root, GREEDY, None)
        assert spec_next == plain_next
    assert accepted_total >= 20, "few drafts accepted: the comparison covers little"
    assert moved_paths >= 1, "no accepted path needed moving: commit_path's copy was not exercised"
