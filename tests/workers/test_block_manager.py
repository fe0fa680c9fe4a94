"""Paged KV-cache bookkeeping (vLLM PagedAttention block tables)."""

from __future__ import annotations

import pytest
import torch

from workers.block_manager import BlockManager, blocks_for_memory, kv_bytes_per_token, size_kv_cache
from workers.models.config import LlamaConfig
from workers.sequence import Sequence


def seq(request_id: str, prompt_len: int = 5) -> Sequence:
    return Sequence(request_id, list(range(prompt_len)), max_tokens=8)


def test_allocate_grows_block_table_to_cover_slots():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = seq("a")
    assert bm.blocks_needed(a, 5) == 2 and bm.can_allocate(a, 5)
    bm.allocate(a, 5)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 4
    bm.allocate(a, 8)  # still inside the second block
    assert len(a.block_table) == 2
    bm.allocate(a, 3)  # never shrinks
    assert len(a.block_table) == 2
    bm.allocate(a, 9)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 3
    assert all(bm.owner(b) == "a" for b in a.block_table)


def test_allocate_without_free_blocks_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    a = seq("a")
    assert not bm.can_allocate(a, 9)
    with pytest.raises(RuntimeError, match="needs 3 KV blocks, 2 free"):
        bm.allocate(a, 9)
    assert a.block_table == [] and bm.num_free_blocks == 2


def test_slots_follow_the_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq("a"), seq("b")
    bm.allocate(a, 4)
    bm.allocate(b, 4)
    bm.allocate(a, 10)
    blocks = a.block_table
    expected = [blocks[p // 4] * 4 + p % 4 for p in range(10)]
    assert bm.slots(a, 0, 10).tolist() == expected
    assert bm.slots(a, 3, 7).dtype == torch.long
    assert [bm.slot(a, p) for p in range(10)] == expected
    assert set(expected).isdisjoint(bm.slots(b, 0, 4).tolist())
    assert bm.trash_slot == 32 and bm.num_slots == 33
    with pytest.raises(IndexError, match="outside its 3 blocks"):
        bm.slots(a, 8, 13)


def test_group_slots_are_each_requests_slots_then_trash():
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b, c = seq("a"), seq("b"), seq("c")
    bm.allocate(a, 4)
    bm.allocate(b, 9)
    bm.allocate(a, 13)  # a's blocks are not consecutive
    bm.allocate(c, 2)
    got = bm.group_slots([a, b, c], [13, 9, 1], 15)
    assert got.shape == (3, 15) and got.dtype == torch.long
    for row, (s, end) in zip(got.tolist(), [(a, 13), (b, 9), (c, 1)]):
        assert row == bm.slots(s, 0, end).tolist() + [bm.trash_slot] * (15 - end)
    with pytest.raises(IndexError, match="outside its 1 blocks"):
        bm.group_slots([c], [5], 8)
    with pytest.raises(IndexError, match="wider than 4"):
        bm.group_slots([a], [5], 4)


def test_free_returns_blocks_and_rejects_double_or_foreign_free():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = seq("a"), seq("b")
    bm.allocate(a, 3)
    bm.allocate(b, 2)
    stale = list(a.block_table)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 3
    bm.free(a)  # an empty table frees nothing
    a.block_table = stale
    with pytest.raises(ValueError, match="it is free"):
        bm.free(a)
    thief = seq("thief")
    thief.block_table = list(b.block_table)
    with pytest.raises(ValueError, match="held by b"):
        bm.free(thief)
    assert bm.num_free_blocks == 3 and all(bm.owner(x) == "b" for x in b.block_table)


def test_look_ahead_blocks_are_kept_and_freed_with_the_sequence():
    """A generation step reserves slots for the draft tree after the committed length; blocks
    wholly beyond the committed length stay with the sequence until it is freed."""
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq("a", prompt_len=7)
    bm.allocate(a, 7)
    a.num_computed_tokens = 7
    tree_tokens = 8
    bm.allocate(a, a.num_computed_tokens + 1 + tree_tokens)  # slots [0, 16)
    assert len(a.block_table) == 4
    a.num_computed_tokens += 2  # one draft token accepted
    bm.allocate(a, a.num_computed_tokens + 1)
    assert len(a.block_table) == 4
    bm.free(a)
    assert bm.num_free_blocks == 10


def test_sizing_from_fraction_or_explicit_count():
    cfg = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    )
    per_token = kv_bytes_per_token(cfg, torch.float32)
    assert per_token == 2 * 3 * 2 * 16 * 4
    assert kv_bytes_per_token(cfg, torch.bfloat16) == per_token // 2
    assert kv_bytes_per_token(cfg, torch.float32, tp_size=2) == per_token // 2
    assert kv_bytes_per_token(cfg, torch.float32, tp_size=4) == per_token // 2  # replicated head
    with pytest.raises(ValueError, match="neither divides"):
        kv_bytes_per_token(cfg, torch.float32, tp_size=3)

    assert blocks_for_memory(per_token, per_token * 16 * 5 + 1, 16) == 5
    size = size_kv_cache(per_token, 16, kv_cache_fraction=0.5, free_bytes=per_token * 16 * 10)
    assert (size.num_blocks, size.num_tokens) == (5, 80)
    assert size.mib == pytest.approx(80 * per_token / 2**20)
    assert "5 blocks x 16 tokens = 80 tokens" in str(size)
    assert size_kv_cache(per_token, 16, num_blocks=7).num_blocks == 7
    with pytest.raises(ValueError, match="exactly one"):
        size_kv_cache(per_token, 16)
    with pytest.raises(ValueError, match="exactly one"):
        size_kv_cache(per_token, 16, num_blocks=3, kv_cache_fraction=0.5, free_bytes=1)
    with pytest.raises(ValueError, match="holds no block"):
        size_kv_cache(per_token, 16, kv_cache_fraction=0.9, free_bytes=per_token)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        size_kv_cache(per_token, 16, kv_cache_fraction=1.5, free_bytes=10**9)
