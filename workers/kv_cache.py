"""KV cache as a flat pool of slots, shared by every sequence of an engine.

A *slot* holds the keys and values of one token in every layer. Sequences own fixed-size blocks of
slots through their block tables (paged KV cache: vLLM PagedAttention, TensorRT-LLM
``tokens_per_block``); the cache itself only stores tensors and knows nothing of sequences. The
last slot is a trash slot that padding tokens write to and nothing reads.

During ReDrafter verification the packed draft tree is written to look-ahead slots after the
committed prefix; :meth:`KVCache.copy_slots` then moves the accepted path into place, so rejected
tokens leave no trace (ReDrafter arXiv 2403.09919 Sec. 3.3; TensorRT-LLM calls this "KV cache
rewind").
"""

from __future__ import annotations

import torch

from workers.forward_batch import AttentionGroup


class KVCache:
    """Keys and values ``k[layer], v[layer]: [num_slots + 1, n_kv_heads, head_dim]`` (last: trash)."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        shape = (num_slots + 1, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.device = torch.device(device)

    @property
    def trash_slot(self) -> int:
        return self.num_slots

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values. slot_mapping: ``[N] long``; k, v: ``[N, n_kv_heads, head_dim]``."""
        self.k[layer].index_copy_(0, slot_mapping, k)
        self.v[layer].index_copy_(0, slot_mapping, v)

    def read(self, layer: int, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[batch, n_kv_heads, kv_len, head_dim]`` of the group's kv slots.

        A group with ``kv_run_start`` set is read as a view (no gather).
        """
        first = group.kv_run_start
        if first is not None:
            k = self.k[layer][first : first + group.kv_len][None]
            v = self.v[layer][first : first + group.kv_len][None]
        else:
            k, v = self.k[layer][group.kv_slots], self.v[layer][group.kv_slots]
        return k.transpose(1, 2), v.transpose(1, 2)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's keys/values from slots ``src`` to ``dst`` (``[K] long`` each)."""
        if src.numel() == 0:
            return
        for cache in (self.k, self.v):
            for layer in cache:
                layer[dst] = layer[src]

