"""Attention for decoding and draft-tree verification on float32 CPU, straight from the paged KV
cache (``decode_attention.c``), and the RoPE + KV-cache write before it (``rope_kv.c``).

At batch 1 and 341 tokens of context, ``scaled_dot_product_attention`` over the gathered or viewed
cache took 155 us per layer and RoPE plus the cache write another 75 us (issue 11); the kernels read
each visible key and value once in place and skip masked ones. Each row's result depends only on
its own query and visible keys in cache order, so a 1-token step and a ReDrafter tree compute the
same bits (greedy speculative output equals plain output). Context chunks take it too
(:data:`MAX_ROWS`), so a prompt's rows do not depend on how it was chunked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from workers.forward_batch import AttentionGroup
from workers.kernels import build

MAX_ROWS: int | None = None
"""Prompt chunks of more than this many tokens use SDPA; None: every group uses the kernel. None by
default: a row's result then never depends on how its prompt was chunked, so chunked prefill and a
prefix-cache hit (which prefills only the uncached suffix) compute the same bits as one whole
prefill. SDPA's results depend on the chunk's shape, and on the int8-activation path such
rounding-level differences flip quantized activations (first-token logprobs moved by up to 0.1 nats
between chunk sizes). Measured on the default model (EPYC Zen 4, ``gguf-avx512-int8``, 512- and
1000-token prompts, alternated runs): prefill time within the run-to-run spread either way."""


KV_DTYPES = (torch.float32, torch.float16, torch.int8)
"""KV-cache element types the kernels read and write (float16: half the bytes a decoding step
reads from the cache; int8: rows of ``head_dim`` bytes and a float32 scale,
:func:`workers.kv_cache.quantize_rows`; the kernels widen each value exactly before float32
arithmetic)."""


def kv_kind(cache: torch.Tensor) -> int:
    """The kernels' code for a cache tensor's element type: 0 float32, 1 float16, 2 int8 rows."""
    return KV_DTYPES.index(cache.dtype)


def cache_head_dim(cache: torch.Tensor) -> int:
    """``head_dim`` of a cache tensor ``[rows, n_kv, head_dim]`` (int8 rows: ``head_dim + 4`` bytes)."""
    return cache.shape[2] - 4 if cache.dtype == torch.int8 else cache.shape[2]


def supports(head_dim: int, n_heads: int, n_kv: int) -> bool:
    """Whether the kernel handles this head shape (``head_dim`` a multiple of 16 up to 1,024, the
    RoPE + KV write's row buffer; GQA groups)."""
    return head_dim % 16 == 0 and 0 < head_dim <= 1024 and n_kv > 0 and n_heads % n_kv == 0


@dataclass
class AttentionPlan:
    """One attention group's kernel inputs, prepared once per forward for every layer.

    mask: ``[batch, seq_len, kv_len] bool`` contiguous; slots: ``[batch, kv_len] int64`` contiguous,
    or None when the group reads the contiguous run ``run_start ..``.
    """

    isa: str
    batch: int
    seq_len: int
    kv_len: int
    mask: torch.Tensor
    slots: torch.Tensor | None
    run_start: int


def plan(isa: str, group: AttentionGroup, num_cache_rows: int) -> AttentionPlan | None:
    """The kernel plan of ``group``, or None when the group is for SDPA: a prompt chunk of more
    than ``MAX_ROWS`` tokens (when set). Decode groups (``group.decode``: plain steps and draft trees of any
    size) always take the kernel, so a row is computed the same way in every step.

    Raises:
        ValueError: a mask or slot list shaped unlike the group, or a slot outside the cache's
            ``num_cache_rows`` rows (the kernel does not check them itself).
    """
    if MAX_ROWS is not None and group.seq_len > MAX_ROWS and not group.decode:
        return None
    B, T, L = group.batch, group.seq_len, group.kv_len
    if tuple(group.mask.shape) != (B, 1, T, L) or group.mask.dtype != torch.bool:
        raise ValueError(f"attention mask must be bool [{B}, 1, {T}, {L}], got {tuple(group.mask.shape)}")
    mask = group.mask.reshape(B, T, L).contiguous()
    if group.kv_run_start is not None:
        if B != 1 or not 0 <= group.kv_run_start <= num_cache_rows - L:
            raise ValueError(f"kv run {group.kv_run_start}+{L} is outside the cache's {num_cache_rows} slots")
        return AttentionPlan(isa, B, T, L, mask, None, group.kv_run_start)
    slots = group.kv_slots.to(torch.int64).contiguous()
    if tuple(slots.shape) != (B, L):
        raise ValueError(f"kv_slots must be [{B}, {L}], got {tuple(slots.shape)}")
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_cache_rows):
        raise ValueError(f"kv_slots outside the cache's {num_cache_rows} slots")
    return AttentionPlan(isa, B, T, L, mask, slots, 0)


def attend(plan: AttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           kernel=None) -> torch.Tensor:
    """Attention of one group's queries over the cache.

    Args:
        q: ``[batch * seq_len, n_heads, head_dim] float32`` (rows request-major; heads and
            head_dim contiguous, rows may be strided).
        k_cache, v_cache: ``[cache_rows, n_kv, head_dim]`` float32 or float16 (widened exactly), or
            ``[cache_rows, n_kv, head_dim + 4]`` int8 rows (:func:`workers.kv_cache.quantize_rows`),
            contiguous (one layer of the :class:`~workers.kv_cache.KVCache`).
        kernel: the C entry point ``rd_decode_attention`` to call; default the plan's build's
            (``benchmarks/decode_attention.py --baseline`` passes one built from another revision).

    Returns:
        ``[batch * seq_len, n_heads * head_dim] float32``, softmax scale ``1 / sqrt(head_dim)``. A
        row whose mask hides every key gets zeros.

    Raises:
        ValueError: shapes that do not match the plan. MemoryError: no scratch memory.
    """
    rows, H, D = q.shape
    HKV = k_cache.shape[1]
    if (rows != plan.batch * plan.seq_len or k_cache.shape[2] != D + 4 * (k_cache.dtype == torch.int8) or q.stride(2) != 1 or q.stride(1) != D or not supports(D, H, HKV)
            or q.dtype != torch.float32 or k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        raise ValueError(f"queries {tuple(q.shape)} do not fit the plan ({plan.batch}x{plan.seq_len} rows) "
                         f"or the kernel (head_dim a multiple of 16, heads a multiple of {HKV}, float32 queries, "
                         f"a contiguous cache of float32, float16 or int8 rows, keys and values alike; got keys "
                         f"{k_cache.dtype} {tuple(k_cache.shape)}, values {v_cache.dtype})")
    out = torch.empty(rows, H * D)
    status = (kernel or build.kernel(plan.isa, "rd_decode_attention"))(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        0 if plan.slots is None else plan.slots.data_ptr(), plan.run_start, plan.mask.data_ptr(), out.data_ptr(),
        plan.batch, plan.seq_len, plan.kv_len, H, HKV, D, 1.0 / math.sqrt(D), kv_kind(k_cache))
    if status:
        raise MemoryError("decode attention could not allocate its scratch memory")
    return out


def rope_write_kv(isa: str, qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                  slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  n_heads: int, n_kv: int) -> torch.Tensor:
    """Rotate queries and keys of the fused QKV output and write keys and values to the cache.

    Args:
        qkv: ``[N, (n_heads + 2 n_kv) head_dim] float32`` contiguous.
        cos, sin_signed: ``[N, 1, head_dim]`` tables of :class:`~workers.models.rope.RotaryEmbedding`.
        slot_mapping: ``[N] long`` cache slot of each token (checked against the cache's rows by
            the caller, once per forward).
        k_cache, v_cache: ``[cache_rows, n_kv, head_dim]`` float32, or float16 (each value rounded to
            the nearest, ties to even, as ``.to(torch.float16)`` rounds), or int8 rows ``[cache_rows,
            n_kv, head_dim + 4]`` (the bits of :func:`workers.kv_cache.quantize_rows`), contiguous,
            written in place.

    Returns:
        rotated queries ``[N, n_heads, head_dim]``, bit-identical to
        :func:`~workers.models.rope.apply_rotary`'s (and so are the cached keys).

    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    N, width = qkv.shape
    D = cache_head_dim(k_cache)
    if (width != (n_heads + 2 * n_kv) * D or k_cache.shape[1] != n_kv or not qkv.is_contiguous()
            or cos.shape != (N, 1, D) or sin_signed.shape != (N, 1, D) or not cos.is_contiguous()
            or not sin_signed.is_contiguous() or slot_mapping.shape != (N,) or slot_mapping.dtype != torch.int64
            or not slot_mapping.is_contiguous() or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or qkv.dtype != torch.float32 or cos.dtype != torch.float32 or k_cache.dtype not in KV_DTYPES
            or v_cache.dtype != k_cache.dtype or D > 1024):
        raise ValueError(f"rope_write_kv: qkv {tuple(qkv.shape)}, tables {tuple(cos.shape)}, slots "
                         f"{tuple(slot_mapping.shape)}, cache {tuple(k_cache.shape)} do not fit {n_heads}+2x{n_kv} heads")
    q = torch.empty(N, n_heads, D)
    build.kernel(isa, "rd_rope_write_kv")(qkv.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), slot_mapping.data_ptr(),
                                          k_cache.data_ptr(), v_cache.data_ptr(), q.data_ptr(), N, n_heads, n_kv, D,
                                          kv_kind(k_cache))
    return q
