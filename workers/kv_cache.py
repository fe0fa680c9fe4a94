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

INT8_SCALE_BYTES = 4
"""An int8 cache row's float32 scale, stored after its ``head_dim`` bytes."""


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows of float32 values -> int8 cache rows: ``[..., D] float32 -> [..., D + 4] int8``.

    Per row (one token's key or value head): ``s = max |x| / 127``, ``y = round(x * (1 / s))``
    (ties to even, within [-127, 127]), then the 4 bytes of ``s``; an all-zero row (``s`` below the
    smallest normal float32) stores ``y = 0, s = 0``, and a row holding a NaN or an infinity ``y = 0,
    s = NaN``, so it reads back as NaN as a float cache's would. The value a row stands for is
    ``s * y`` (:func:`dequantize_rows`), within ``s / 2`` of ``x``. Absmax quantization per token and head, as llama.cpp's q8_0 KV cache does per 32 values
    and TensorRT-LLM's INT8 KV cache per tensor. The C write (``workers/kernels/rope_kv.c``,
    ``to_int8``) computes the same bits, so either path may fill a cache the other reads.
    """
    x = x.float()
    bad = ~torch.isfinite(x).all(-1, keepdim=True)
    x = x.masked_fill(bad, 0.0)
    s = x.abs().amax(-1, keepdim=True) / 127.0
    zero = s < torch.finfo(torch.float32).tiny
    s = s.masked_fill(zero, 0.0)
    inv = torch.where(zero, torch.zeros_like(s), 1.0 / torch.where(zero, torch.ones_like(s), s))
    y = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    s = s.masked_fill(bad, float("nan"))
    return torch.cat([y, s.contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 cache rows ``[..., D + 4]`` -> the values they stand for ``[..., D]`` in ``dtype``."""
    y, s = rows[..., :-INT8_SCALE_BYTES], rows[..., -INT8_SCALE_BYTES:].contiguous().view(torch.float32)
    return (y.float() * s).to(dtype)


class KVCache:
    """Keys and values ``k[layer], v[layer]: [num_slots + 1, n_kv_heads, head_dim]`` (last: trash).

    ``dtype`` is what the cache stores; ``compute_dtype`` (default: ``dtype``) what :meth:`write`
    receives and :meth:`read` returns. A float16 cache under a float32 model (vLLM's and
    TensorRT-LLM's ``kv_cache_dtype``) halves the bytes a decoding step reads from it; values round
    to the nearest float16 when written. An int8 cache stores each token's key/value head as
    ``head_dim`` bytes and a float32 scale (:func:`quantize_rows`: tensors ``[num_slots + 1,
    n_kv_heads, head_dim + 4] int8``), a bit over a quarter of float32's bytes.
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
        shape = (num_slots + 1, n_kv_heads, head_dim + INT8_SCALE_BYTES * (dtype == torch.int8))
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.dtype = dtype
        self.compute_dtype = compute_dtype or (torch.float32 if dtype == torch.int8 else dtype)

    @property
    def trash_slot(self) -> int:
        return self.num_slots

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values. slot_mapping: ``[N] long``; k, v: ``[N, n_kv_heads, head_dim]``."""
        if self.dtype == torch.int8:
            k, v = quantize_rows(k), quantize_rows(v)
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
        if self.dtype == torch.int8:
            k, v = dequantize_rows(k, self.compute_dtype), dequantize_rows(v, self.compute_dtype)
        elif self.dtype != self.compute_dtype:
            k, v = k.to(self.compute_dtype), v.to(self.compute_dtype)
        return k, v

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's keys/values from slots ``src`` to ``dst`` (``[K] long`` each)."""
        if src.numel() == 0:
            return
        for cache in (self.k, self.v):
            for layer in cache:
                layer[dst] = layer[src]

