"""KV cache rewind after draft-tree verification (ReDrafter arXiv 2403.09919 Sec. 3.3).

After a speculative step the committed slots must hold exactly the keys/values plain decoding of the
same tokens writes; the cache reads block-table slots by gathering, contiguous runs as views.
"""

from __future__ import annotations

import random

import torch

from workers.engine_builder import load_engine
from workers.forward_batch import AttentionGroup
from workers.kv_cache import KVCache
from workers.sampling_params import SamplingParams


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


def test_a_float16_cache_stores_rounded_values_and_reads_the_compute_dtype():
    """engine.kv_cache_dtype float16 under a float32 model: writes round to float16 (to nearest,
    ties to even), reads (the SDPA path) return float32 views of the stored values."""
    cache = KVCache(num_layers=1, num_slots=8, n_kv_heads=2, head_dim=4, dtype=torch.float16,
                    compute_dtype=torch.float32)
    k, v = torch.randn(3, 2, 4) * 100, torch.randn(3, 2, 4)
    k[0, 0, 0] = 2049.0  # halfway between float16 2048 and 2050
    cache.write(0, torch.tensor([1, 5, 2]), k, v)
    assert cache.k[0].dtype == torch.float16 and cache.k[0][1, 0, 0].item() == 2048.0
    assert torch.equal(cache.k[0][[1, 5, 2]], k.half()) and torch.equal(cache.v[0][[1, 5, 2]], v.half())
    keys, values = cache.read(0, AttentionGroup(0, 1, 1, torch.tensor([[5, 2]]), torch.ones(1, 1, 1, 2, dtype=torch.bool)))
    assert keys.dtype == values.dtype == torch.float32
    assert torch.equal(keys[0], k[1:].half().float().transpose(0, 1))


@torch.inference_mode()
def test_committed_slots_equal_plain_decoding(tiny_model_dirs, trained_drafter_dirs):
    """A speculative and a plain request with the same prompt decode side by side in one engine;
    after every iteration the keys/values of their common committed prefix agree."""
    engine = load_engine(str(tiny_model_dirs["tied_gqa2"]), str(trained_drafter_dirs["tied_gqa2"]), num_beams=4,
                    draft_len_per_beam=4, max_seq_len=256, tokens_per_block=4, num_kv_blocks=200)
    cache, blocks = engine.executor.cache, engine.blocks
    copies = []
    copy = engine.executor.copy_slots
    engine.executor.copy_slots = lambda src, dst: (copies.append(len(src)), copy(src, dst))
    rng = random.Random(0)
    accepted_total = compared = 0
    for case in range(4):
        prompt = [rng.randrange(3, engine.config.vocab_size) for _ in range(rng.randint(2, 30))]
        engine.add_request(f"spec{case}", prompt, SamplingParams(max_tokens=40), "spec")
        engine.add_request(f"plain{case}", prompt, SamplingParams(max_tokens=40), "plain")
        while engine.num_unfinished:
            for d in engine.step():
                if d.request_id.startswith("spec"):
                    accepted_total = max(accepted_total, d.accepted_draft_tokens)
            running = {s.request_id: s for s in engine.scheduler.running}
            spec, plain = running.get(f"spec{case}"), running.get(f"plain{case}")
            if spec is None or plain is None:
                continue
            L = min(spec.num_computed_tokens, plain.num_computed_tokens)
            a, b = blocks.slots(spec, 0, L), blocks.slots(plain, 0, L)
            for layer in range(engine.config.num_hidden_layers):
                assert torch.allclose(cache.k[layer][a], cache.k[layer][b], atol=1e-5)
                assert torch.allclose(cache.v[layer][a], cache.v[layer][b], atol=1e-5)
            compared += 1
    assert accepted_total >= 5, "few drafts accepted: the comparison covers little"
    assert compared >= 20 and copies, "no accepted path needed moving: copy_slots was not exercised"
