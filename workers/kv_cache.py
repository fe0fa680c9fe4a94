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
    """Keys and values ``k[layer], v[layer]: [num_slots + 1, n_kv_heads, head_dim]`` (last: trash).

    ``dtype`` is what the cache stores; ``compute_dtype`` (default: ``dtype``) what :meth:`write`
    receives and :meth:`read` returns. A float16 cache under a float32 model (vLLM's and
    TensorRT-LLM's ``kv_cache_dtype``) halves the bytes a decoding step reads from it; values round
    to the nearest float16 when written.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        compute_dtype: torch.dtype | None = None,
    ):
        shape = (num_slots + 1, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype

    @property
    def trash_slot(self) -> int:
        return self.num_slots

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values. slot_mapping: ``[N] long``; k, v: ``[N, n_kv_heads, head_dim]``."""
        self.k[layer].index_copy_(0, slot_mapping, k.to(self.dtype))
        self.v[layer].index_copy_(0, slot_mapping, v.to(self.dtype))

    def read(self, layer: int, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[batch, n_kv_heads, kv_len, head_dim]`` of the group's kv slots, in
        ``compute_dtype``.

        A group with ``kv_run_start`` set is read as a view (no gather).
        """
        first = group.kv_run_start
        if first is not None:
            k = self.k[layer][first : first + group.kv_len][None]
            v = self.v[layer][first : first + group.kv_len][None]
        else:
            k, v = self.k[layer][group.kv_slots], self.v[layer][group.kv_slots]
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.dtype != self.compute_dtype:
            k, v = k.to(self.compute_dtype), v.to(self.compute_dtype)
        return k, v

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's keys/values from slots ``src`` to ``dst`` (``[K] long`` each)."""
        if src.numel() == 0:
            return
        for cache in (self.k, self.v):
            for layer in cache:
                layer[dst] = layer[src]

