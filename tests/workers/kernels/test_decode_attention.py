"""The decode attention and RoPE + KV-write kernels (workers/kernels/decode_attention.py): values
against float64 SDPA, masks with holes, GQA, draft-tree rows, slots out of order, the row
independence that keeps speculative output equal to plain output, and both instruction-set builds
(``isa`` fixture)."""

from __future__ import annotations

import pytest
from compute_paths import require_both_builds
import torch
import torch.nn.functional as F

from workers.forward_batch import AttentionGroup
from workers.kernels import build
from workers.kernels.decode_attention import attend, plan, rope_write_kv
from workers.models.rope import RotaryEmbedding, apply_rotary

TOL = 2e-6  # absolute, on outputs of size ~1 (values drawn from N(0, 1))


def reference(q, k_cache, v_cache, slots, mask):
    """float64 SDPA over gathered keys: q [B*T, H, D], slots [B, L], mask [B, 1, T, L] -> [B*T, H*D]."""
    B, _, T, L = mask.shape
    H, D = q.shape[1:]
    k, v = k_cache[slots].double().transpose(1, 2), v_cache[slots].double().transpose(1, 2)
    out = F.scaled_dot_product_attention(q.double().view(B, T, H, D).transpose(1, 2), k, v, attn_mask=mask,
                                         enable_gqa=True)
    return out.transpose(1, 2).reshape(B * T, H * D)


def random_case(B, T, L, H, HKV, D, seed=0, holes=0.3):
    rows = max(300, 2 * L)
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = torch.randn(rows, HKV, D, generator=g), torch.randn(rows, HKV, D, generator=g)
    slots = torch.stack([torch.randperm(rows, generator=g)[:L] for _ in range(B)])  # out of order, per request
    mask = torch.rand(B, 1, T, L, generator=g) >= holes
    mask[..., -1] = True
    q = torch.randn(B * T, H, D, generator=g)
    return q, k_cache, v_cache, slots, mask


@pytest.mark.parametrize("B,T,L", [(1, 1, 1), (1, 1, 341), (1, 3, 100), (2, 5, 37), (3, 1, 64), (1, 33, 129),
                                   (2, 64, 70)])
@pytest.mark.parametrize("H,HKV,D", [(9, 3, 64), (4, 2, 16), (4, 4, 32), (6, 1, 128), (2, 1, 48)])
def test_matches_sdpa(B, T, L, H, HKV, D, isa):
    q, kc, vc, slots, mask = random_case(B, T, L, H, HKV, D, seed=B * 100 + T + L + H)
    got = attend(plan(isa, AttentionGroup(0, B, T, slots, mask), kc.shape[0]), q, kc, vc)
    assert got.shape == (B * T, H * D) and got.dtype == torch.float32
    assert (got.double() - reference(q, kc, vc, slots, mask)).abs().max() < TOL


def test_contiguous_run_and_strided_queries(isa):
    """A group on one run of slots is read in place; queries may be a strided view (the rows of a
    packed q|k|v)."""
    H, HKV, D, T, L, start = 9, 3, 64, 3, 50, 17
    _, kc, vc, _, _ = random_case(1, T, L, H, HKV, D)
    packed = torch.randn(T, H + 2 * HKV, D)
    q = packed[:, :H]
    mask = torch.ones(T, L, dtype=torch.bool)
    mask[:, L - T:] = torch.ones(T, T, dtype=torch.bool).tril()
    slots = torch.arange(start, start + L)[None]
    group = AttentionGroup(0, 1, T, slots, mask[None, None], kv_run_start=start)
    got = attend(plan(isa, group, kc.shape[0]), q, kc, vc)
    assert (got.double() - reference(q.contiguous(), kc, vc, slots, mask[None, None])).abs().max() < TOL


def test_a_row_depends_only_on_its_visible_keys_in_order(isa):
    """What keeps greedy speculative decoding bit-identical to plain decoding: a row computed alone
    over exactly its visible keys (a plain step) equals the same row inside a bigger call (a draft
    tree next to other requests), where masked keys sit between the visible ones at other positions
    and hold NaN."""
    H, HKV, D, L = 9, 3, 64, 90
    q, kc, vc, _, _ = random_case(1, 1, L, H, HKV, D)
    visible = torch.randperm(250)[:L]
    alone = attend(plan(isa, AttentionGroup(0, 1, 1, visible[None], torch.ones(1, 1, 1, L, dtype=torch.bool)),
                        kc.shape[0]), q, kc, vc)
    poisoned = torch.arange(250, 300)
    kc[poisoned], vc[poisoned] = float("nan"), float("nan")
    T, width = 5, L + 50
    slots = torch.empty(2, width, dtype=torch.long)
    mask = torch.zeros(2, 1, T, width, dtype=torch.bool)
    where = torch.sort(torch.randperm(width)[:L]).values  # visible keys keep their order, at other positions
    others = torch.tensor([i for i in range(width) if i not in set(where.tolist())])
    slots[1, where], slots[1, others] = visible, poisoned
    mask[1, 0, 3, where] = True
    slots[0] = torch.randperm(250)[:width]
    mask[0] = torch.rand(1, T, width) < 0.5
    mask[0, :, :, 0] = True
    mask[1, 0, :3, others[0]] = True  # other rows of the request see a poisoned key; row 3 does not
    queries = torch.randn(2 * T, H, D)
    queries[T + 3] = q[0]
    together = attend(plan(isa, AttentionGroup(0, 2, T, slots, mask), kc.shape[0]), queries, kc, vc)
    assert torch.equal(together[T + 3], alone[0])


def tree_and_chunk_masks(B, T, L, seed):
    """Masks as the engine builds them: each request's rows see its whole context (the dense part the
    kernel takes without mask checks, rows in blocks) and then a draft tree's ancestors (random) or a
    prompt chunk's earlier rows (causal); one request's row 1 sees nothing of its tail."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, 1, T, L, dtype=torch.bool)
    for b in range(B):
        P = L - T
        mask[b, 0, :, :P] = True
        tail = torch.ones(T, T, dtype=torch.bool).tril() if b % 2 else (torch.rand(T, T, generator=g) < 0.4).tril()
        mask[b, 0, :, P:] = tail | torch.eye(T, dtype=torch.bool)
    if B > 1 and T > 2:
        mask[1, 0, 1, L - T:] = False
        mask[1, 0, 1, 5] = False  # a hole in row 1's context: its dense run ends early
    return mask


@pytest.mark.parametrize("B,T,L", [(1, 2, 40), (2, 3, 100), (1, 7, 301), (2, 13, 64), (1, 17, 129), (2, 40, 90)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_tree_and_chunk_rows_equal_each_row_alone(B, T, L, kv_dtype, isa):
    """Rows that share their context are taken together (keys read once for 2-3 rows' scores, values
    once for blocks of up to 6 rows): every row still gets the bits it gets alone over its visible
    keys, at every block size and for both cache dtypes, and matches float64 SDPA."""
    q, kc, vc, slots, _ = random_case(B, T, L, 9, 3, 64, seed=T * 7 + L)
    mask = tree_and_chunk_masks(B, T, L, seed=T + L)
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    got = attend(plan(isa, AttentionGroup(0, B, T, slots, mask), kc.shape[0]), q, kc, vc)
    assert (got.double() - reference(q, kc.float(), vc.float(), slots, mask)).abs().max() < TOL
    for b in range(B):
        for t in range(T):
            seen = mask[b, 0, t].nonzero().flatten()
            alone_mask = torch.ones(1, 1, 1, len(seen), dtype=torch.bool)
            alone = attend(plan(isa, AttentionGroup(0, 1, 1, slots[b, seen][None], alone_mask), kc.shape[0]),
                           q[b * T + t : b * T + t + 1], kc, vc)
            assert torch.equal(got[b * T + t], alone[0]), (b, t)


@pytest.mark.parametrize("B,T,L", [(1, 1, 300), (16, 1, 70), (1, 7, 301), (2, 40, 90)])
@pytest.mark.parametrize("H,HKV", [(9, 3), (8, 1), (4, 2)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_query_heads_taken_together_get_the_bits_of_each_head_alone(B, T, L, H, HKV, kv_dtype, isa):
    """The G query heads of a key/value head are computed together (each key and value loaded once
    for them, rows split across threads in chunks): each head's output equals, bit for bit, the same
    head computed alone (one query head over its own key/value head, the head-by-head path)."""
    q, kc, vc, slots, _ = random_case(B, T, L, H, HKV, 64, seed=H * 31 + T + L)
    mask = tree_and_chunk_masks(B, T, L, seed=T + L + H)
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
    got = attend(plan(isa, AttentionGroup(0, B, T, slots, mask), kc.shape[0]), q, kc, vc).view(B * T, H, 64)
    G = H // HKV
    for h in range(H):
        kvh = h // G
        alone = attend(plan(isa, AttentionGroup(0, B, T, slots, mask), kc.shape[0]), q[:, h : h + 1].contiguous(),
                       kc[:, kvh : kvh + 1].contiguous(), vc[:, kvh : kvh + 1].contiguous())
        assert torch.equal(got[:, h], alone), h


@pytest.mark.parametrize("B,T", [(0, 1), (0, 3), (1, 0)])
def test_an_empty_group_returns_no_rows(B, T, isa):
    """No request or no row: an empty result, not a crash (the grouped path divides work by both)."""
    q, kc, vc, _, _ = random_case(1, 1, 10, 4, 2, 16)
    slots = torch.zeros(B, 10, dtype=torch.int64)
    mask = torch.ones(B, 1, T, 10, dtype=torch.bool)
    got = attend(plan(isa, AttentionGroup(0, B, T, slots, mask), kc.shape[0]), q[: B * T], kc, vc)
    assert got.shape == (0, 4 * 16)


def test_row_without_visible_keys_is_zero(isa):
    q, kc, vc, slots, mask = random_case(1, 2, 20, 4, 2, 16)
    mask[0, 0, 1] = False
    got = attend(plan(isa, AttentionGroup(0, 1, 2, slots, mask), kc.shape[0]), q, kc, vc)
    assert torch.equal(got[1], torch.zeros(4 * 16))
    assert got[0].abs().sum() > 0


def test_both_builds_compute_the_same_bits():
    require_both_builds()
    q, kc, vc, slots, mask = random_case(2, 7, 333, 9, 3, 64)
    outs = [attend(plan(isa, AttentionGroup(0, 2, 7, slots, mask), kc.shape[0]), q, kc, vc)
            for isa in ("avx512", "avx2")]
    assert torch.equal(outs[0], outs[1])


def test_long_prompt_chunks_take_the_kernel_row_by_row_and_bad_slots_are_refused(isa, monkeypatch):
    """A prompt chunk of any length takes the kernel (MAX_ROWS None), and each of its rows computes the
    bits it computes alone: a prompt's rows do not depend on its chunking (prefix caching relies on
    it). With MAX_ROWS set, longer prompt chunks go to SDPA; draft trees never do."""
    q, kc, vc, slots, mask = random_case(1, 65, 80, 4, 2, 16)
    chunk = plan(isa, AttentionGroup(0, 1, 65, slots, mask), kc.shape[0])
    assert chunk is not None
    got = attend(chunk, q, kc, vc)
    for row in (0, 31, 64):
        alone = attend(plan(isa, AttentionGroup(0, 1, 1, slots, mask[:, :, row:row + 1]), kc.shape[0]),
                       q[row:row + 1], kc, vc)
        assert torch.equal(got[row:row + 1], alone)
    import workers.kernels.decode_attention as decode_attention

    monkeypatch.setattr(decode_attention, "MAX_ROWS", 64)
    assert plan(isa, AttentionGroup(0, 1, 65, slots, mask), kc.shape[0]) is None
    assert plan(isa, AttentionGroup(0, 1, 65, slots, mask, decode=True), kc.shape[0]) is not None
    _, kc, _, slots, mask = random_case(1, 2, 10, 4, 2, 16)
    slots[0, 3] = kc.shape[0]
    with pytest.raises(ValueError, match="kv_slots outside"):
        plan(isa, AttentionGroup(0, 1, 2, slots, mask), kc.shape[0])
    with pytest.raises(ValueError, match="kv run"):
        plan(isa, AttentionGroup(0, 1, 2, slots, mask, kv_run_start=kc.shape[0] - 5), kc.shape[0])


@pytest.mark.parametrize("H,HKV,D", [(9, 3, 64), (4, 2, 16), (2, 2, 128)])
def test_rope_and_kv_write_equal_the_torch_path(H, HKV, D, isa):
    """Bit-identical to apply_rotary + KVCache.write, including a repeated (trash) slot."""
    N, rows = 6, 40
    rotary = RotaryEmbedding(D, 512, 10000.0, None)
    cos, sin = rotary(torch.tensor([0, 5, 300, 7, 7, 511]), torch.float32)
    qkv = torch.randn(N, (H + 2 * HKV) * D)
    slots = torch.tensor([3, 9, 0, 39, 39, 17])
    kc, vc = torch.zeros(rows, HKV, D), torch.zeros(rows, HKV, D)
    q = rope_write_kv(isa, qkv, cos, sin, slots, kc, vc, H, HKV)
    qk = apply_rotary(qkv[:, : (H + HKV) * D].view(N, H + HKV, D), cos, sin)
    want_k, want_v = torch.zeros(rows, HKV, D), torch.zeros(rows, HKV, D)
    for n in range(N):  # in order: of rows 3 and 4 (both slot 39), the later one wins
        want_k[slots[n]], want_v[slots[n]] = qk[n, H:], qkv[n, (H + HKV) * D:].view(HKV, D)
    assert torch.equal(q, qk[:, :H])
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    with pytest.raises(ValueError, match="do not fit"):
        rope_write_kv(isa, qkv, cos, sin, slots, kc, vc, H + 1, HKV)


@pytest.mark.parametrize("B,T,L", [(1, 1, 341), (3, 1, 64), (1, 7, 200), (2, 5, 37), (1, 65, 80)])
def test_a_float16_cache_gives_the_bits_of_its_values_widened(B, T, L, isa):
    """A float16 KV cache (engine.kv_cache_dtype) is read by widening each value exactly: one row
    and several rows (a tree or prompt chunk, whose rows share each widened key and value) both
    equal the float32 kernel over the same values, bit for bit, with masked holes and out-of-order
    slots."""
    q, kc, vc, slots, mask = random_case(B, T, L, 9, 3, 64, seed=B + T + L)
    kh, vh = kc.half(), vc.half()
    p = plan(isa, AttentionGroup(0, B, T, slots, mask), kc.shape[0])
    got = attend(p, q, kh, vh)
    assert torch.equal(got, attend(p, q, kh.float(), vh.float()))
    assert (got.double() - reference(q, kh.float(), vh.float(), slots, mask)).abs().max() < TOL
    with pytest.raises(ValueError, match="float16 or int8 rows"):
        attend(p, q, kh, vc)  # keys and values of different dtypes


def test_rope_and_kv_write_round_to_a_float16_cache_as_torch_does(isa):
    """Writing to a float16 cache rounds each key and value to the nearest float16 (ties to even),
    as ``.to(torch.float16)`` does, so the C and torch paths fill the cache with the same bits;
    queries stay float32."""
    H, HKV, D, N, rows = 9, 3, 64, 6, 40
    rotary = RotaryEmbedding(D, 512, 10000.0, None)
    cos, sin = rotary(torch.tensor([0, 5, 300, 7, 7, 511]), torch.float32)
    qkv = torch.randn(N, (H + 2 * HKV) * D) * 30  # some values beyond float16's subnormal and rounding edges
    qkv[0, (H + HKV) * D] = 2049.0  # halfway between two float16 values: rounds to even (2048)
    slots = torch.tensor([3, 9, 0, 39, 39, 17])
    k32, v32 = torch.zeros(rows, HKV, D), torch.zeros(rows, HKV, D)
    q32 = rope_write_kv(isa, qkv, cos, sin, slots, k32, v32, H, HKV)
    k16, v16 = torch.zeros(rows, HKV, D, dtype=torch.float16), torch.zeros(rows, HKV, D, dtype=torch.float16)
    q16 = rope_write_kv(isa, qkv, cos, sin, slots, k16, v16, H, HKV)
    assert q16.dtype == torch.float32 and torch.equal(q16, q32)
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half())
    assert v16[3, 0, 0].item() == 2048.0
