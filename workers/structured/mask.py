"""Token masks: the grammar library's packed bitmask to a bool mask, and bool mask onto logits."""

from __future__ import annotations

import numpy as np
import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool mask from a packed bitmask: bit ``j`` of word ``w`` is token ``32 * w + j``.

    bitmask: ``[N, ceil(vocab_size / 32)] int32`` on CPU (xgrammar's layout).
    Returns ``[N, vocab_size] bool``, True = allowed (a new tensor; ``bitmask`` may be reused).
    One ``numpy.unpackbits`` pass (C, no per-bit temporaries), faster than torch shift-and-mask.
    """
    packed = bitmask.numpy().astype("<i4", copy=False).view(np.uint8)  # little-endian words -> bytes
    bits = np.unpackbits(packed, axis=-1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def apply_allowed(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits with every forbidden token at -inf (out-of-place; ``logits`` is left unchanged).

    logits: ``[N, V] float32``; allowed: ``[N, V] bool`` (``RequestGrammar.tree_allowed``), on
    logits' device or CPU (moved). Returns ``[N, V] float32``.

    Raises:
        ValueError: the shapes differ.
    """
    if logits.shape != allowed.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and allowed {tuple(allowed.shape)} differ")
    return logits.masked_fill(~allowed.to(logits.device, non_blocking=True), float("-inf"))
