"""Greedy decoding's argmax over the vocabulary in C (``argmax.c``) for float32 CPU logits."""

from __future__ import annotations

import torch

from workers.kernels import build


def argmax_rows(isa: str, logits: torch.Tensor) -> torch.Tensor:
    """Per row of ``logits`` (``[N, V] float32``, contiguous, CPU) the index of its first NaN, else of
    its first maximum: ``[N] long``, the indices of torch's ``logits.max(dim=-1).indices``.

    Args:
        isa: the kernel build (:func:`workers.kernels.build.load`).

    Raises:
        ValueError: ``logits`` is not a contiguous 2-D float32 CPU tensor with at least one column.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_cpu or not logits.is_contiguous() \
            or logits.shape[1] == 0:
        raise ValueError(f"argmax_rows takes contiguous [N, V>0] float32 CPU logits, got {tuple(logits.shape)} "
                         f"{logits.dtype} on {logits.device}")
    out = torch.empty(logits.shape[0], dtype=torch.long)
    build.kernel(isa, "rd_argmax_rows")(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
    return out
