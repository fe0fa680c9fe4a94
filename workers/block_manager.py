"""Paged KV-cache bookkeeping: fixed-size blocks, a free list, one block table per sequence.

The cache holds ``num_blocks * block_size`` token slots plus one trash slot (slot
``num_blocks * block_size``) that padding tokens write to. A sequence's token at position ``p`` lives
in slot ``block_table[p // block_size] * block_size + p % block_size`` (vLLM PagedAttention,
Kwon et al. 2023; TensorRT-LLM "paged KV cache" with ``tokens_per_block``).

Draft trees need no scratch blocks: a generation step writes the last token and its draft tree to
the sequence's own look-ahead slots at positions ``L .. L + tree_tokens`` (``L`` =
``num_computed_tokens``), so the scheduler only calls ``allocate(seq, L + 1 + tree_tokens)``; the
engine then compacts the accepted path to positions ``L + 1 ..``. Blocks wholly beyond the committed
length stay in the block table after the step: the sequence reuses them as it grows, and
:meth:`BlockManager.free` returns them with the rest.

Automatic prefix caching (``enable_prefix_caching``; vLLM's scheme): a full block of prompt tokens,
once computed, is registered under its chain hash (:mod:`workers.prefix_hash`). A new request takes
the longest chain of registered blocks of its prompt (:meth:`BlockManager.match_prefix`) and prefills
only the rest. Blocks have holders (reference counts): a block is shared read-only by every request
that matched it and is never written while held, because only whole blocks of prompt positions are
registered and a request writes only at positions past the blocks it matched. A block no one holds
stays registered (and counts as free) until an allocation needs it: then the least recently released
one is evicted. Draft trees and generated tokens never enter a registered block: those blocks hold
prompt positions only, computed in the context phase.

This module holds no tensors except the slot indices :meth:`BlockManager.slots` returns.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from workers.models.config import LlamaConfig
from workers.sequence import Sequence

MiB = 1 << 20


class BlockManager:
    """Owns the free list, the registered (cached) blocks and which sequences hold each block.

    Raises ``ValueError`` on a double free or when freeing a block the sequence does not hold, and
    ``RuntimeError`` when :meth:`allocate` is called without enough free blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # no holder, not registered
        self._evictable: OrderedDict[int, None] = OrderedDict()  # no holder, registered; least recent first
        self._holders: list[list[str]] = [[] for _ in range(num_blocks)]
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never used, or registered and held by no one (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks (prefix cache), held or not."""
        return len(self._block_of)

    @property
    def trash_slot(self) -> int:
        """Slot padding tokens write to; no sequence ever reads it."""
        return self.num_blocks * self.block_size

    @property
    def num_slots(self) -> int:
        """Rows of the KV-cache tensors: every block's slots plus the trash slot."""
        return self.num_blocks * self.block_size + 1

    def blocks_needed(self, seq: Sequence, upto_slots: int) -> int:
        """New blocks ``seq`` needs so that its slots ``[0, upto_slots)`` exist (0 if it has them)."""
        return max(0, -(-upto_slots // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, upto_slots: int) -> bool:
        return self.blocks_needed(seq, upto_slots) <= self.num_free_blocks

    def allocate(self, seq: Sequence, upto_slots: int) -> None:
        """Grow ``seq.block_table`` so that slots ``[0, upto_slots)`` exist; never shrinks it.

        Raises:
            RuntimeError: not enough free blocks (check :meth:`can_allocate` first).
        """
        needed = self.blocks_needed(seq, upto_slots)
        if needed > self.num_free_blocks:
            raise RuntimeError(
                f"request {seq.request_id}: needs {needed} KV blocks, {self.num_free_blocks} free"
            )
        for _ in range(needed):
            if self._free:
                block = self._free.popleft()
            else:  # evict the least recently released cached block
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of[block]]
                self._hash_of[block] = None
            self._holders[block].append(seq.request_id)
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` and empty its block table: a block no one else holds goes
        to the free list, or, when registered, stays cached (evictable, most recent last).

        Raises:
            ValueError: ``seq`` does not hold a block of its table (already free, or another's).
        """
        for block in seq.block_table:
            if seq.request_id not in self._holders[block]:
                holders = self._holders[block]
                held = "free" if not holders else f"held by {', '.join(holders)}"
                raise ValueError(f"request {seq.request_id}: cannot free KV block {block}: it is {held}")
        for block in seq.block_table:
            holders = self._holders[block]
            holders.remove(seq.request_id)
            if not holders:
                if self._hash_of[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None
        seq.block_table = []

    def match_prefix(self, seq: Sequence, hashes: list[bytes], max_tokens: int) -> int:
        """Take the registered blocks of the longest chain of ``hashes`` (``seq``'s prompt blocks,
        :func:`workers.prefix_hash.block_hashes`) covering at most ``max_tokens`` tokens; returns the
        tokens they hold (0 with caching off). ``seq`` must hold no blocks yet.

        Raises:
            ValueError: ``seq`` already holds blocks.
        """
        if seq.block_table:
            raise ValueError(f"request {seq.request_id}: match_prefix on a sequence holding blocks")
        if not self.enable_prefix_caching:
            return 0
        for h in hashes[: max(0, max_tokens) // self.block_size]:
            block = self._block_of.get(h)
            if block is None:
                break
            self._evictable.pop(block, None)
            self._holders[block].append(seq.request_id)
            seq.block_table.append(block)
        return len(seq.block_table) * self.block_size

    def register(self, seq: Sequence, hashes: list[bytes], num_tokens: int) -> None:
        """Register ``seq``'s blocks whose ``num_tokens`` leading tokens are computed and whose hash
        is known (``hashes``: its prompt's full blocks). A block whose content another block already
        holds stays unregistered (it is freed as usual)."""
        if not self.enable_prefix_caching:
            return
        for i in range(min(len(hashes), num_tokens // self.block_size, len(seq.block_table))):
            block, h = seq.block_table[i], hashes[i]
            if self._hash_of[block] is None and h not in self._block_of:
                self._hash_of[block] = h
                self._block_of[h] = block

    def owner(self, block: int) -> str | None:
        """A request id holding ``block`` (the first to take it), or None when no one does."""
        holders = self._holders[block]
        return holders[0] if holders else None

    def holders(self, block: int) -> list[str]:
        """Request ids holding ``block``."""
        return list(self._holders[block])

    def slot(self, seq: Sequence, position: int) -> int:
        """Cache slot of ``seq``'s token at ``position``.

        Raises:
            IndexError: the position's block is not allocated.
        """
        return self.slots(seq, position, position + 1).item()

    def slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Cache slots ``[end - start] long`` of positions ``[start, end)``.

        Raises:
            IndexError: a position is negative or its block is not allocated.
        """
        if start < 0 or end > len(seq.block_table) * self.block_size:
            raise IndexError(
                f"request {seq.request_id}: positions [{start}, {end}) outside its "
                f"{len(seq.block_table)} blocks of {self.block_size}"
            )
        positions = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def group_slots(self, seqs: list[Sequence], ends: list[int], width: int) -> torch.Tensor:
        """Cache slots ``[len(seqs), width] long`` of positions ``[0, width)`` of each sequence: row
        ``i`` holds :meth:`slots` ``(seqs[i], 0, ends[i])`` then the trash slot up to ``width``. One
        set of tensor operations for a whole attention group (a batch-16 decode step spent ~0.4 ms
        calling :meth:`slots` per request).

        Raises:
            IndexError: an end is beyond its sequence's blocks, or ``width`` is below an end.
        """
        bs = self.block_size
        for seq, end in zip(seqs, ends):
            if end > len(seq.block_table) * bs or end > width:
                raise IndexError(f"request {seq.request_id}: positions [0, {end}) outside its "
                                 f"{len(seq.block_table)} blocks of {bs} (or wider than {width})")
        n_blocks = -(-width // bs)
        table = torch.tensor([seq.block_table[:n_blocks] + [0] * (n_blocks - min(n_blocks, len(seq.block_table)))
                              for seq in seqs], dtype=torch.long)
        positions = torch.arange(width)
        out = table[:, positions // bs] * bs + positions % bs
        return out.masked_fill_(positions >= torch.tensor(ends)[:, None], self.trash_slot)


def kv_bytes_per_token(config: LlamaConfig, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Keys plus values of one token in every layer on one rank, in bytes.

    KV heads are split across ``tp_size`` ranks (``num_key_value_heads / tp_size`` each); with more
    ranks than KV heads each rank holds one replicated head (vLLM's rule).

    Raises:
        ValueError: neither count divides the other.
    """
    kv_heads = config.num_key_value_heads
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(f"tp_size {tp_size} and num_key_value_heads {kv_heads}: neither divides the other")
    heads = max(1, kv_heads // tp_size)
    row = config.head_size + 4 if dtype == torch.int8 else config.head_size * dtype.itemsize  # int8: + its scale
    return 2 * config.num_hidden_layers * heads * row


def blocks_for_memory(bytes_per_token: int, budget_bytes: int, block_size: int) -> int:
    """Whole blocks of ``block_size`` tokens that fit in ``budget_bytes``."""
    return int(budget_bytes) // (bytes_per_token * block_size)


@dataclass(frozen=True)
class KVCacheSize:
    """Size of a paged KV cache, as the engine reports it at start."""

    num_blocks: int
    block_size: int
    bytes_per_token: int
    dtype: str = "float32"  # what it stores (engine.kv_cache_dtype resolved: float32, bfloat16, float16, int8)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def mib(self) -> float:
        return self.num_tokens * self.bytes_per_token / MiB

    def __str__(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens, "
            f"{self.mib:.1f} MiB ({self.dtype}, {self.bytes_per_token} bytes/token)"
        )


def size_kv_cache(
    bytes_per_token: int,
    block_size: int,
    *,
    num_blocks: int | None = None,
    kv_cache_fraction: float | None = None,
    free_bytes: int | None = None,
) -> KVCacheSize:
    """Size the cache from an explicit ``num_blocks``, or from ``kv_cache_fraction`` of
    ``free_bytes`` (memory free after loading the weights; TensorRT-LLM's
    ``free_gpu_memory_fraction``, vLLM's ``gpu_memory_utilization``).

    Raises:
        ValueError: neither or both ways given, a fraction outside (0, 1], or less than one block.
    """
    if (num_blocks is None) == (kv_cache_fraction is None):
        raise ValueError("give exactly one of num_blocks and kv_cache_fraction")
    if num_blocks is None:
        if not 0 < kv_cache_fraction <= 1:
            raise ValueError(f"kv_cache_fraction must be in (0, 1], got {kv_cache_fraction}")
        if free_bytes is None:
            raise ValueError("kv_cache_fraction needs free_bytes")
        num_blocks = blocks_for_memory(bytes_per_token, kv_cache_fraction * free_bytes, block_size)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_fraction {kv_cache_fraction} of {free_bytes / MiB:.1f} MiB free holds no "
                f"block of {block_size} tokens x {bytes_per_token} bytes"
            )
    elif num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    return KVCacheSize(num_blocks, block_size, bytes_per_token)
