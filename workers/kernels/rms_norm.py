"""RMSNorm, optionally fused with the residual add before it, on float32 CPU rows (``rms_norm.c``).

A pre-norm decoder runs two of these per layer; as torch ops each costs about 50 us at batch 1
(five small ops on 576 floats), so 61 calls were 3.1 ms of a 21 ms step on SmolLM2-135M (issue 11).
"""

from __future__ import annotations

import torch

from workers.kernels import build


def rms_norm(isa: str, x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> torch.Tensor:
    """``x += delta`` (in place, when given), then ``(x * rsqrt(mean(x^2) + eps)) * weight`` per row.

    Args:
        isa: the kernel build (:func:`workers.kernels.build.load`).
        x: ``[rows, n] float32`` contiguous CPU (the residual stream; updated in place with delta).
        weight: ``[n] float32``.
        eps: added to the mean square (``rms_norm_eps``).
        delta: ``[rows, n] float32`` or None.

    Returns:
        ``[rows, n] float32``, a new tensor. Rows are independent; the sum of squares is summed in
        another order than torch's, so results match torch's RMSNorm within float32 rounding.

    Raises:
        ValueError: a tensor that is not float32 on CPU, or shapes that do not match.
    """
    if x.dim() != 2 or x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous():
        raise ValueError(f"rms_norm takes a contiguous [rows, n] float32 CPU x, got {tuple(x.shape)} {x.dtype}")
    if weight.shape != x.shape[1:] or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"rms_norm weight must be float32 [{x.shape[1]}], got {tuple(weight.shape)} {weight.dtype}")
    if delta is not None:
        if delta.shape != x.shape or delta.dtype != torch.float32 or not delta.is_cpu:
            raise ValueError(f"rms_norm delta must be float32 {tuple(x.shape)}, got {tuple(delta.shape)} {delta.dtype}")
        delta = delta.contiguous()
    out = torch.empty_like(x)
    build.kernel(isa, "rd_rms_norm")(x.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(),
                                     out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out
