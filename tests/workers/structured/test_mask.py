import pytest
import torch

from workers.structured.mask import apply_allowed, unpack_bitmask


def test_unpack_bitmask_matches_bit_shifts():
    vocab_size = 70  # not a multiple of 32: the last word's high bits are dropped
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 3), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    expected = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().view(3, -1)[:, :vocab_size]
    assert torch.equal(unpack_bitmask(bitmask, vocab_size), expected)


def test_apply_allowed_is_out_of_place():
    logits = torch.arange(6, dtype=torch.float32).view(2, 3)
    allowed = torch.tensor([[True, False, True], [False, False, True]])
    masked = apply_allowed(logits, allowed)
    assert masked.tolist() == [[0.0, float("-inf"), 2.0], [float("-inf"), float("-inf"), 5.0]]
    assert logits.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    with pytest.raises(ValueError, match="differ"):
        apply_allowed(logits, allowed[:1])
