"""The decoder stack's forward in one C call (``decoder.c``) on the float32 CPU path, and SwiGLU's
``silu(gate) * up`` in C.

:meth:`workers.models.llama.LlamaModel.forward` with the C kernels on runs, per layer, two fused
norms, four projections, RoPE + KV write, attention per group and ``silu * up``: about a dozen
Python calls and small torch ops per layer, ~100 us of glue at batch 1 (a third of a SmolLM2-135M
decode step on two cores). :func:`decoder_forward` runs the same kernels in the same order from
one call, so it returns the same bits, whenever the step allows it (:func:`fused_layers`): every
projection on rdserve's kernels (:class:`~workers.kernels.packed_linear.PackedLinear`,
:class:`~workers.kernels.quant_linear.QuantLinear`), every attention group on the C attention
kernel, no prompt rows on the bfloat16 prefill path.
"""

from __future__ import annotations

import ctypes
import math
import weakref

import torch

from workers.kernels import build
from workers.kernels.decode_attention import AttentionPlan, kv_kind
from workers.kernels.packed_linear import PackedLinear
from workers.kernels.quant_linear import QuantLinear

LINEAR_KINDS = {"rd_linear_packed": 0, "rd_linear_q4_1": 1, "rd_linear_q8_0": 2, "rd_linear_q4_1_vnni": 3,
                "rd_linear_q8_0_vnni": 4, "rd_linear_q4_1_int8_avx2": 5, "rd_linear_q8_0_int8_avx2": 6,
                "rd_linear_q4_1_amx": 7, "rd_linear_q8_0_amx": 8}
_L, _P = ctypes.c_long, ctypes.c_void_p


class _Lin(ctypes.Structure):
    _fields_ = [("kind", _L), ("K", _L), ("N", _L), ("w", _P), ("bias", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin), ("down", _Lin), ("post_norm", _P),
                ("next_norm", _P), ("k_cache", _P), ("v_cache", _P), ("kv_kind", _L)]


class _Group(ctypes.Structure):
    _fields_ = [("start", _L), ("batch", _L), ("seq_len", _L), ("kv_len", _L), ("run_start", _L), ("slots", _P),
                ("mask", _P)]


def silu_mul(isa: str, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate_up[:, :inter]) * gate_up[:, inter:]`` (SwiGLU) in C (``rd_silu_mul``).

    Args:
        isa: the kernel build (:func:`workers.kernels.build.load`).
        gate_up: ``[rows, 2 * inter] float32`` contiguous CPU.

    Returns:
        ``[rows, inter] float32``; within a few ulp of torch's ``F.silu(g) * u`` for gates above
        -87 (below: ``-0 * u``, where exact silu is under 1e-36), the same bits for a value whatever
        its row, position, ``inter`` or build.

    Raises:
        ValueError: a shape or dtype that does not fit.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * inter or gate_up.dtype != torch.float32 or \
            not gate_up.is_contiguous() or not gate_up.is_cpu:
        raise ValueError(f"silu_mul takes a contiguous float32 [rows, {2 * inter}] CPU tensor, got "
                         f"{tuple(gate_up.shape)} {gate_up.dtype}")
    out = torch.empty(gate_up.shape[0], inter)
    build.kernel(isa, "rd_silu_mul")(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter)
    return out


def _layer_key(model, cache) -> tuple | None:
    """Everything the C layer table points to, read fresh: per layer its four projections (the
    module, its entry point, weight and bias pointers, whether it has a bfloat16 prefill weight),
    its norm weights' and KV cache layers' pointers. None when a projection is not on rdserve's
    kernels. (Module dicts are read directly: this runs every step.)"""
    layers = list(model._modules["layers"]._modules.values())
    final = model._modules["norm"]._parameters["weight"].data_ptr()
    key = []
    add = key.extend
    for i, layer in enumerate(layers):
        mods = layer._modules
        attn, mlp = mods["self_attn"]._modules, mods["mlp"]._modules
        for m in (attn["qkv_proj"], attn["o_proj"], mlp["gate_up_proj"], mlp["down_proj"]):
            t = type(m)
            if t is not QuantLinear and t is not PackedLinear:
                return None
            d = m.__dict__
            bias = d["bias"] if "bias" in d else m.bias
            add((m, d.get("_entry", "rd_linear_packed"), d["_buffers"]["panels"].data_ptr(),
                 0 if bias is None else bias.data_ptr(), d.get("prefill_weight") is not None))
        nxt = layers[i + 1]._modules["input_layernorm"] if i + 1 < len(layers) else None
        add((mods["post_attention_layernorm"]._parameters["weight"].data_ptr(),
             final if nxt is None else nxt._parameters["weight"].data_ptr(), cache.k[i].data_ptr(), cache.v[i].data_ptr(),
             kv_kind(cache.k[i])))
    return tuple(key)


_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (key, table, prefill weights)


def fused_layers(model, cache, batch, masks) -> ctypes.Array | None:
    """The per-layer C descriptions of ``model`` (a :class:`~workers.models.llama.LlamaModel`) for
    this step, or None when the step must take the Python path: a projection that is not on
    rdserve's kernels (torch's ``nn.Linear``, tensor-parallel layers), a group without a C attention
    plan (long prompt chunks on SDPA), or prompt rows on the bfloat16 prefill path.

    The table is rebuilt only when something it points to changed (every pointer, entry point and
    shape is compared each step: replaced or re-allocated weights, biases, norms or KV cache layers
    are never read through a stale pointer) and is kept beside the model, not in it (a model stays
    copyable and picklable)."""
    if not all(isinstance(m, AttentionPlan) for m in masks):
        return None
    key = _layer_key(model, cache)
    if key is None:
        return None
    entry = _TABLES.get(model)
    if entry is None or entry[0] != key:
        entry = _TABLES[model] = (key, *_build_table(key, len(model.layers)))
    table, prefill_weights = entry[1], entry[2]
    if prefill_weights:
        rows = batch.prefill_rows
        if bool(rows.numel()) if isinstance(rows, torch.Tensor) else bool(rows):
            return None
    return table


def _build_table(key: tuple, n_layers: int) -> tuple[ctypes.Array | None, bool]:
    """(the layer table of :func:`_layer_key`'s ``key``, whether some projection has a bfloat16
    prefill weight)."""
    out = (_Layer * n_layers)()
    per_lin, per_layer = 5, 4 * 5 + 5
    prefill_weights = False
    for i in range(n_layers):
        k = key[i * per_layer : (i + 1) * per_layer]
        lins = []
        for j in range(4):
            module, entry, w, b, prefill = k[j * per_lin : (j + 1) * per_lin]
            kind = LINEAR_KINDS.get(entry)
            if kind is None:
                return None, False
            lins.append(_Lin(kind, module.in_features, module.out_features, w, b))
            prefill_weights |= prefill
        out[i] = _Layer(*lins, *k[4 * per_lin :])
    return out, prefill_weights


def decoder_forward(model, layers: ctypes.Array, isa: str, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                    batch, masks: list[AttentionPlan]) -> torch.Tensor | None:
    """Run the whole stack in C; returns the final-normed hidden states ``[N, hidden] float32``
    (``x``, the embeddings, is used as the residual stream and overwritten), or None when the
    groups do not tile the rows in order (the Python path then runs; nothing was written).

    Raises:
        ValueError: tensors that do not fit. MemoryError: scratch memory could not be allocated.
    """
    N, hidden = x.shape
    cfg = model.config
    D = cfg.head_size
    cos, sin = rope
    groups = (_Group * len(masks))()
    start = 0
    for i, (g, plan) in enumerate(zip(batch.groups, masks)):
        if g.start != start:
            return None
        groups[i] = _Group(start, plan.batch, plan.seq_len, plan.kv_len, plan.run_start,
                           0 if plan.slots is None else plan.slots.data_ptr(), plan.mask.data_ptr())
        start += plan.batch * plan.seq_len
    if start != N:
        return None
    if not (x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and cos.shape == (N, 1, D)
            and sin.shape == cos.shape and batch.slot_mapping.dtype == torch.int64 and batch.slot_mapping.is_contiguous()):
        raise ValueError(f"decoder_forward: x {tuple(x.shape)}, rope {tuple(cos.shape)}, slots "
                         f"{batch.slot_mapping.dtype} do not fit")
    h = torch.empty_like(x)
    status = build.kernel(isa, "rd_decoder_forward")(
        ctypes.addressof(layers), len(layers), ctypes.addressof(groups), len(groups), x.data_ptr(), h.data_ptr(), model.layers[0].input_layernorm.weight.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), batch.slot_mapping.data_ptr(), N, hidden, cfg.num_attention_heads,
        cfg.num_key_value_heads, D, cfg.intermediate_size, cfg.rms_norm_eps, 1.0 / math.sqrt(D))
    if status == -1:
        raise MemoryError(f"the decoder could not allocate scratch memory for {N} rows")
    if status:
        raise RuntimeError(f"rd_decoder_forward failed with status {status}")
    return h
