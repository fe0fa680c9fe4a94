"""How layers split over ranks (pure functions of the config; no MPI)."""

from __future__ import annotations

import pytest

from workers.models.config import LlamaConfig
from workers.tp.layers import check_tp_size, head_split, vocab_split


def cfg(heads: int, kv_heads: int, inter: int = 128) -> LlamaConfig:
    return LlamaConfig(vocab_size=397, hidden_size=64, intermediate_size=inter, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv_heads)


def test_kv_heads_split_when_tp_divides_them():
    splits = [head_split(8, 4, 2, r) for r in range(2)]
    assert splits == [(range(0, 4), range(0, 2)), (range(4, 8), range(2, 4))]


@pytest.mark.parametrize("heads,kv_heads,tp", [(8, 2, 4), (8, 2, 8), (4, 2, 4), (8, 1, 8)])
def test_kv_heads_replicated_when_fewer_than_ranks(heads, kv_heads, tp):
    group = heads // kv_heads  # query heads per KV head
    for r in range(tp):
        q, kv = head_split(heads, kv_heads, tp, r)
        assert len(kv) == 1
        assert all(h // group == kv.start for h in q)  # every local query head reads the local KV head


def test_vocab_slices_cover_the_vocabulary_with_padding():
    for tp in (1, 2, 4, 8):
        slices = [vocab_split(397, tp, r) for r in range(tp)]
        assert [s[0] for s in slices] == [min(r * slices[0][2], 397) for r in range(tp)]
        assert slices[-1][1] == 397 and all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
        assert slices[0][2] * tp >= 397


@pytest.mark.parametrize("heads,kv_heads,inter,tp,message", [
    (8, 2, 128, 3, "num_attention_heads"),
    (8, 8, 100, 8, "intermediate_size"),
    (12, 6, 120, 4, "num_key_value_heads"),
])
def test_unsplittable_tp_size_is_rejected(heads, kv_heads, inter, tp, message):
    with pytest.raises(ValueError, match=message):
        check_tp_size(cfg(heads, kv_heads, inter), tp)
