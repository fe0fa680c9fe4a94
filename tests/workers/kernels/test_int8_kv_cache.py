"""An int8 KV cache (``engine.kv_cache_dtype: int8``): rows of ``head_dim`` int8 values and a float32
scale (workers/kv_cache.py's quantize_rows). The C write and the torch write store the same bits;
the attention kernel reads int8 rows as the float values they stand for (against float64 SDPA over
the dequantized cache); tree and chunk rows, and query heads taken together, keep the bits of each
row and head alone, so speculative output still equals plain output; both builds agree."""

from __future__ import annotations

import pytest
from compute_paths import require_both_builds
import torch

from workers.forward_batch import AttentionGroup
from workers.kernels.decode_attention import attend, plan, rope_write_kv
from workers.kv_cache import KVCache, dequantize_rows, quantize_rows
from workers.models.rope import RotaryEmbedding, apply_rotary

from test_decode_attention import TOL, random_case, reference, tree_and_chunk_masks


def test_quantize_rows_round_half_to_even_within_half_a_step_and_keep_zero_rows():
    x = torch.randn(5, 3, 64) * torch.tensor([1e-3, 1.0, 300.0])[None, :, None]
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0
    x[1, 1, :2] = torch.tensor([-2.54, 2.54])  # the row's extremes: -127 and 127 exactly
    x[1, 1, 2:] = torch.linspace(-1, 1, 62)
    rows = quantize_rows(x)
    assert rows.shape == (5, 3, 68) and rows.dtype == torch.int8
    y, s = rows[..., :64], rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(y[0, 0], torch.zeros(64, dtype=torch.int8)) and s[0, 0].item() == 0.0
    assert y[1, 1, 0].item() == -127 and y[1, 1, 1].item() == 127
    assert (s.squeeze(-1) - x.abs().amax(-1) / 127).abs().max() == 0
    back = dequantize_rows(rows)
    assert back.shape == x.shape and back.dtype == torch.float32
    assert ((back - x).abs() <= s * 0.5 * (1 + 1e-5)).all()
    # a row holding a NaN or an infinity reads back as NaN (as a float cache's would), the others not
    odd = torch.randn(3, 8)
    odd[0, 2], odd[1, 5] = float("nan"), float("-inf")
    back = dequantize_rows(quantize_rows(odd))
    assert back[:2].isnan().all() and back[2].isfinite().all()
    # ties go to even: 0.5 and 1.5 steps of a row whose scale is exactly 1
    tie = torch.zeros(1, 64)
    tie[0, :3] = torch.tensor([127.0, 0.5, 1.5])
    assert quantize_rows(tie)[0, 1:3].tolist() == [0, 2]


def test_kv_cache_stores_int8_rows_reads_floats_and_moves_scales_with_slots():
    cache = KVCache(num_layers=2, num_slots=10, n_kv_heads=2, head_dim=16, dtype=torch.int8)
    assert cache.k[0].shape == (11, 2, 20) and cache.compute_dtype == torch.float32
    k, v = torch.randn(3, 2, 16) * 7, torch.randn(3, 2, 16)
    cache.write(1, torch.tensor([2, 7, 4]), k, v)
    assert torch.equal(cache.k[1][[2, 7, 4]], quantize_rows(k)) and torch.equal(cache.v[1][[2, 7, 4]], quantize_rows(v))
    keys, values = cache.read(1, AttentionGroup(0, 1, 1, torch.tensor([[7, 4]]), torch.ones(1, 1, 1, 2, dtype=torch.bool)))
    assert keys.dtype == torch.float32 and keys.shape == (1, 2, 2, 16)
    assert torch.equal(keys[0], dequantize_rows(quantize_rows(k[1:])).transpose(0, 1))
    cache.copy_slots(torch.tensor([7]), torch.tensor([9]))  # a tree's accepted row moved into place
    assert torch.equal(cache.k[1][9], cache.k[1][7]) and torch.equal(cache.v[1][9], cache.v[1][7])


@pytest.mark.parametrize("H,HKV,D", [(9, 3, 64), (4, 2, 16), (2, 2, 128)])
def test_the_c_write_stores_the_bits_of_the_torch_write(H, HKV, D, isa):
    """RoPE + KV write in C into an int8 cache equals apply_rotary + quantize_rows bit for bit (the
    C and torch paths may fill one cache), including zero rows and a repeated (trash) slot."""
    N, rows = 6, 40
    rotary = RotaryEmbedding(D, 512, 10000.0, None)
    cos, sin = rotary(torch.tensor([0, 5, 300, 7, 7, 511]), torch.float32)
    qkv = torch.randn(N, (H + 2 * HKV) * D) * torch.tensor([1e-4, 1, 30, 1, 1, 500])[:, None]
    qkv[2, (H + HKV) * D:] = 0.0  # a token whose values are all zero
    qkv[1, (H + HKV) * D + 1] = float("inf")  # a value row holding an infinity, a key row a NaN: scale NaN
    qkv[5, H * D + 3] = float("nan")
    slots = torch.tensor([3, 9, 0, 39, 39, 17])
    kc, vc = (torch.zeros(rows, HKV, D + 4, dtype=torch.int8) for _ in range(2))
    q = rope_write_kv(isa, qkv, cos, sin, slots, kc, vc, H, HKV)
    qk = apply_rotary(qkv[:, : (H + HKV) * D].view(N, H + HKV, D), cos, sin)
    assert torch.equal(q, qk[:, :H])
    want_k, want_v = quantize_rows(qk[:, H:]), quantize_rows(qkv[:, (H + HKV) * D:].view(N, HKV, D))
    for n in (0, 1, 2, 4, 5):  # of rows 3 and 4 (both slot 39), the later one wins
        assert torch.equal(kc[slots[n]], want_k[n]) and torch.equal(vc[slots[n]], want_v[n]), n
    assert dequantize_rows(vc[slots[1]])[0].isnan().all() and dequantize_rows(vc[slots[1]])[1:].isfinite().all()
    assert dequantize_rows(kc[slots[5]])[0].isnan().all()
    with pytest.raises(ValueError, match="do not fit"):
        rope_write_kv(isa, qkv, cos, sin, slots, kc, vc, H + 1, HKV)


@pytest.mark.parametrize("B,T,L", [(1, 1, 1), (1, 1, 341), (3, 1, 64), (16, 1, 70), (1, 7, 200), (2, 5, 37),
                                   (1, 65, 80)])
@pytest.mark.parametrize("H,HKV,D", [(9, 3, 64), (4, 4, 32), (6, 1, 128)])
def test_attention_over_int8_rows_matches_sdpa_over_their_values(B, T, L, H, HKV, D, isa):
    q, kc, vc, slots, mask = random_case(B, T, L, H, HKV, D, seed=B * 7 + T + L + H)
    k8, v8 = quantize_rows(kc * 3), quantize_rows(vc)
    p = plan(isa, AttentionGroup(0, B, T, slots, mask), kc.shape[0])
    got = attend(p, q, k8, v8)
    assert got.shape == (B * T, H * D)
    assert (got.double() - reference(q, dequantize_rows(k8), dequantize_rows(v8), slots, mask)).abs().max() < TOL
    with pytest.raises(ValueError, match="float16 or int8 rows"):
        attend(p, q, k8, vc)  # keys and values of different dtypes


@pytest.mark.parametrize("B,T,L", [(1, 2, 40), (2, 3, 100), (1, 7, 301), (2, 13, 64), (2, 40, 90)])
def test_tree_and_chunk_rows_get_the_bits_of_each_row_alone(B, T, L, isa):
    q, kc, vc, slots, _ = random_case(B, T, L, 9, 3, 64, seed=T * 5 + L)
    mask = tree_and_chunk_masks(B, T, L, seed=T + L)
    k8, v8 = quantize_rows(kc), quantize_rows(vc)
    got = attend(plan(isa, AttentionGroup(0, B, T, slots, mask), kc.shape[0]), q, k8, v8)
    for b in range(B):
        for t in range(T):
            seen = mask[b, 0, t].nonzero().flatten()
            alone = attend(plan(isa, AttentionGroup(0, 1, 1, slots[b, seen][None],
                                                    torch.ones(1, 1, 1, len(seen), dtype=torch.bool)), kc.shape[0]),
                           q[b * T + t : b * T + t + 1], k8, v8)
            assert torch.equal(got[b * T + t], alone[0]), (b, t)


@pytest.mark.parametrize("B,T,L", [(1, 1, 300), (16, 1, 70), (1, 7, 301), (2, 40, 90)])
@pytest.mark.parametrize("H,HKV", [(9, 3), (8, 1), (4, 2)])
def test_query_heads_taken_together_get_the_bits_of_each_head_alone(B, T, L, H, HKV, isa):
    q, kc, vc, slots, _ = random_case(B, T, L, H, HKV, 64, seed=H * 13 + T + L)
    mask = tree_and_chunk_masks(B, T, L, seed=T + L + H)
    k8, v8 = quantize_rows(kc), quantize_rows(vc)
    p = plan(isa, AttentionGroup(0, B, T, slots, mask), kc.shape[0])
    got = attend(p, q, k8, v8).view(B * T, H, 64)
    G = H // HKV
    for h in range(H):
        kvh = h // G
        alone = attend(p, q[:, h : h + 1].contiguous(), k8[:, kvh : kvh + 1].contiguous(),
                       v8[:, kvh : kvh + 1].contiguous())
        assert torch.equal(got[:, h], alone), h


def test_both_builds_read_int8_rows_to_the_same_bits():
    require_both_builds()
    q, kc, vc, slots, mask = random_case(2, 7, 333, 9, 3, 64)
    k8, v8 = quantize_rows(kc), quantize_rows(vc)
    outs = [attend(plan(isa, AttentionGroup(0, 2, 7, slots, mask), kc.shape[0]), q, k8, v8)
            for isa in ("avx512", "avx2")]
    assert torch.equal(outs[0], outs[1])
