"""The distinct-first draft (:func:`~workers.redrafter.beam_search.draft_distinct_first_batch`) in one C
call (``workers/kernels/drafter.c``) when the drafter runs on rdserve's CPU kernels.

The Python search makes about 20 torch calls and 5 projections per draft position, most of its time
call overhead at batch 1 (BENCHMARKS.md, kernels and step breakdown). The C path runs the same projections on the same kernels in the same order; its SiLU is
the decoder's (a few ulp from torch's), so a near-tie between two draft tokens may be broken the
other way. Proposals only: verification, and so the output, does not depend on them.

With one beam, or one draft token per beam, ReDrafter's beam search
(:func:`~workers.redrafter.beam_search.draft_beams_batch`) proposes the same beams up to near-ties
(it ranks log-probabilities, whose rounding can merge logits a few ulp apart), so the engine takes
this path then too.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from workers.kernels import build
from workers.kernels.decoder import LINEAR_KINDS, _Lin
from workers.kernels.packed_linear import PackedLinear
from workers.kernels.quant_linear import QuantLinear
from workers.redrafter.drafter import ReDrafter

MAX_DRAFT_LAYERS = 8  # drafter.c's RD_MAX_DRAFT_LAYERS
MAX_WIDTH = 64  # drafter.c's top-k buffer
_L, _P = ctypes.c_long, ctypes.c_void_p


class _Drafter(ctypes.Structure):
    _fields_ = [("rnn_w", _Lin), ("rnn_u", _Lin), ("blocks", _Lin * MAX_DRAFT_LAYERS), ("n_blocks", _L),
                ("has_out_proj", _L), ("out_proj", _Lin), ("head", _Lin), ("embed", _P), ("draft_vocab", _P),
                ("H", _L), ("vocab", _L)]


def _lin(m, in_features: int, out_features: int | None = None) -> _Lin | None:
    """``m``'s C description, or None unless it is one of rdserve's CPU kernels with intact buffers
    (uint8 blocks or float32 panels, a float32 bias, all contiguous on the CPU) of the given shape."""
    if type(m) is not QuantLinear and type(m) is not PackedLinear:
        return None
    kind = LINEAR_KINDS.get(m.__dict__.get("_entry", "rd_linear_packed"))
    panels, bias = m._buffers["panels"], m.bias
    ok_panels = panels.dtype == (torch.uint8 if type(m) is QuantLinear else torch.float32)
    ok_bias = bias is None or (bias.dtype == torch.float32 and bias.is_cpu and bias.is_contiguous()
                               and bias.numel() == m.out_features)
    if (kind is None or not ok_panels or not panels.is_cpu or not panels.is_contiguous() or not ok_bias
            or m.in_features != in_features or (out_features is not None and m.out_features != out_features)):
        return None
    return _Lin(kind, m.in_features, m.out_features, panels.data_ptr(), 0 if bias is None else bias.data_ptr())


def _key(drafter: ReDrafter, embed_weight: torch.Tensor) -> tuple:
    mods = [drafter.rnn_w, drafter.rnn_u, *[b.linear for b in drafter.lm_head[: drafter.config.num_draft_layers]],
            getattr(drafter, "out_proj", None), drafter._packed_head]
    ptrs = []
    for m in mods:
        panels = None if m is None else m._buffers.get("panels")
        ptrs.append(None if panels is None else (
            id(m), m.__dict__.get("_entry"), panels.data_ptr(), panels.dtype, panels.numel(), m.in_features,
            m.out_features, None if m.bias is None else (m.bias.data_ptr(), m.bias.dtype)))
    vocab = drafter.draft_vocab
    return (*ptrs, (embed_weight.data_ptr(), tuple(embed_weight.shape)),
            None if vocab is None else (vocab.data_ptr(), vocab.numel()))


def _build(drafter: ReDrafter, embed_weight: torch.Tensor) -> _Drafter | None:
    cfg = drafter.config
    vocab = drafter.draft_vocab
    if drafter._packed_head is None or vocab is None or cfg.num_draft_layers > MAX_DRAFT_LAYERS:
        return None  # the full-vocabulary heads are plain tensors, not on the kernels
    if vocab.dtype != torch.long or not vocab.is_contiguous() or not vocab.is_cpu or not vocab.numel() or \
            int(vocab.min()) < 0 or int(vocab.max()) >= embed_weight.shape[0]:
        return None
    H, shared = cfg.hidden_size, cfg.head_type == "shared"
    blocks = [_lin(b.linear, 2 * H, 2 * H) for b in drafter.lm_head[: cfg.num_draft_layers]]
    rnn_w, rnn_u = _lin(drafter.rnn_w, H, H), _lin(drafter.rnn_u, H, H)
    out_proj = _lin(drafter.out_proj, 2 * H, H) if shared else _Lin()
    head = _lin(drafter._packed_head, H if shared else 2 * H, vocab.numel())
    if any(lin is None for lin in (*blocks, rnn_w, rnn_u, out_proj, head)):
        return None
    return _Drafter(rnn_w, rnn_u, (_Lin * MAX_DRAFT_LAYERS)(*blocks), cfg.num_draft_layers, int(shared), out_proj,
                    head, embed_weight.data_ptr(), vocab.data_ptr(), H, embed_weight.shape[0])


_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # drafter -> (key, table or None)


def fused_table(drafter: ReDrafter, embed_weight: torch.Tensor) -> _Drafter | None:
    """The C description of ``drafter`` (rebuilt when a weight it points to changed), or None when
    it cannot take the C path: a layer not on rdserve's CPU kernels (CUDA, bfloat16, torch's GEMM) or
    of an unexpected shape, no restricted draft vocabulary (the full-vocabulary heads are plain
    tensors) or one with ids outside the embedding, or an embedding that is not a contiguous float32
    CPU ``[vocab, H]`` table."""
    if (embed_weight.dtype != torch.float32 or not embed_weight.is_cpu or not embed_weight.is_contiguous()
            or embed_weight.dim() != 2 or embed_weight.shape[1] != drafter.config.hidden_size):
        return None
    key = _key(drafter, embed_weight)
    entry = _TABLES.get(drafter)
    if entry is None or entry[0] != key:
        entry = _TABLES[drafter] = (key, _build(drafter, embed_weight))
    return entry[1]


def draft_distinct_first_fused(drafter: ReDrafter, embed_weight: torch.Tensor, context: torch.Tensor,
                               roots: torch.Tensor, num_beams: int, draft_len_per_beam: int,
                               with_probs: bool = False):
    """:func:`~workers.redrafter.beam_search.draft_distinct_first_batch` in C, or None when the drafter
    cannot take the C path (:func:`fused_table`; the caller then runs the Python search).

    Args:
        embed_weight: the base model's input embedding ``[vocab, H] float32`` (``e`` in Sec. 3.1).
        context: ``[B, H] float32`` base hidden states; roots: ``[B] long``.
        with_probs: also return each drafted token's probability.

    Returns:
        beams ``[B, width, draft_len_per_beam + 1] long``, ``width = min(num_beams, draft vocabulary)``;
        column 0 is the root, beams ordered by their first draft token's logit. With ``with_probs``,
        ``(beams, probs)``: ``probs [B, width, draft_len_per_beam] float32`` the drafter's softmax
        probability of each drafted token given its beam's earlier tokens (as
        :func:`~workers.redrafter.beam_search.draft_distinct_first_batch` with ``with_probs``; NaN
        where the logits hold a NaN).

    Raises:
        ValueError: ``num_beams`` or ``draft_len_per_beam`` below 1, shapes that do not fit, or a root
            token outside the embedding.
        MemoryError: the kernel could not allocate its scratch memory.
    """
    if num_beams < 1 or draft_len_per_beam < 1:
        raise ValueError(f"num_beams and draft_len_per_beam must be >= 1, got {num_beams}, {draft_len_per_beam}")
    table = fused_table(drafter, embed_weight)
    if table is None or num_beams > MAX_WIDTH:
        return None
    B, H = context.shape
    if H != drafter.config.hidden_size or roots.shape != (B,):
        raise ValueError(f"context {tuple(context.shape)} and roots {tuple(roots.shape)} do not fit a drafter of "
                         f"hidden size {drafter.config.hidden_size}")
    ctx = context.detach().to("cpu", torch.float32).contiguous()
    roots = roots.to("cpu", torch.long).contiguous()
    width = min(num_beams, table.head.N)
    out = torch.empty(B, width, draft_len_per_beam + 1, dtype=torch.long)
    probs = torch.empty(B, width, draft_len_per_beam, dtype=torch.float32) if with_probs else None
    status = build.kernel(drafter._packed_head.isa, "rd_draft_distinct_first")(
        ctypes.addressof(table), ctx.data_ptr(), roots.data_ptr(), B, width, draft_len_per_beam, out.data_ptr(),
        None if probs is None else probs.data_ptr())
    if status == -1:
        raise MemoryError(f"the drafter could not allocate scratch memory for {B * width} rows")
    if status == -4:
        raise ValueError(f"a root token is outside the embedding's {embed_weight.shape[0]} rows: {roots.tolist()}")
    if status:
        raise RuntimeError(f"rd_draft_distinct_first failed with status {status}")
    return (out, probs) if with_probs else out
