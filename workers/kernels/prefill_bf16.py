"""Prompt rows of a GGUF-block linear on oneDNN's bfloat16 GEMM (AMX tiles): faster prefill.

Prefill multiplies every prompt token by every weight, so it is compute-bound. On the default
model's shapes at 300 rows and 2 threads, float32 FMA (torch's MKL or our panel kernels) peaks near
220 GFLOPS; oneDNN's bfloat16 GEMM on AMX tiles runs 700-1800 GFLOPS. :class:`~workers.kernels.
quant_linear.QuantLinear` sends its leading prompt rows here (``engine.prefill_dtype``) and keeps
decode steps and draft trees on its float32 kernels, so greedy speculative output stays
bit-identical to plain output: a prompt is prefilled the same way in both modes.

Row independence: oneDNN picks its blocking, and so the order in which a row's products are summed,
from the GEMM's row count. :func:`prefill_linear` always calls it on blocks of exactly
:data:`BLOCK_ROWS` rows (the last one zero-padded), so every row's result is independent of the
chunk the scheduler put it in and of its neighbours: a prompt gives the same KV cache however it is
chunked or batched. The partition also changes with the thread count (measured: 1-4 threads give
the same bits on every shape here, 8 and 16 do not), so these GEMMs run on at most
:data:`MAX_THREADS` threads: an engine's output does not depend on how many threads it has, as
with the float32 kernels.

Precision: weights (the dequantized GGUF values) and activations are rounded to bfloat16 (8-bit
mantissa) and the products summed in float32 by the AMX tiles; outputs are rounded to bfloat16 and
return as float32. The effect on output (greedy agreement, perplexity) is measured in BENCHMARKS.md
("Prefill in bfloat16"), as the TensorRT-LLM and llama.cpp prefill paths with reduced-precision
activations are.
"""

from __future__ import annotations


import torch

BLOCK_ROWS = 64
MAX_THREADS = 4
PREFILL_DTYPES = ("auto", "float32", "bfloat16")


def amx_bf16_available() -> bool:
    """Whether this CPU has AMX bfloat16 tiles (Linux ``/proc/cpuinfo`` flag ``amx_bf16``); False
    where that cannot be read."""
    from workers.kernels.build import missing_cpu_flags

    return not missing_cpu_flags({"amx_bf16"})


def resolve_prefill_dtype(setting: str) -> str:
    """``engine.prefill_dtype`` -> ``"bfloat16"`` or ``"float32"``: ``"auto"`` is bfloat16 where the
    CPU has AMX bfloat16 tiles (elsewhere oneDNN's bfloat16 GEMM is not faster than float32).

    Raises:
        ValueError: a setting other than auto, float32, bfloat16.
    """
    if setting not in PREFILL_DTYPES:
        raise ValueError(f"prefill_dtype must be one of {', '.join(PREFILL_DTYPES)}, got {setting!r}")
    if setting == "auto":
        return "bfloat16" if amx_bf16_available() else "float32"
    return setting


def prefill_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for prompt rows, in blocks of :data:`BLOCK_ROWS` rows.

    Args:
        x: float32 ``[M, K]`` (any M >= 1).
        weight: bfloat16 ``[N, K]``, contiguous.
        bias: float32 ``[N]`` or None.

    Returns:
        float32 ``[M, N]``; row i depends only on ``x[i]``, whatever the chunk, its neighbours or the
        thread count (see the module docstring).
    """
    m = x.shape[0]
    xb = x.to(torch.bfloat16)
    pad = -m % BLOCK_ROWS
    if pad:
        xb = torch.nn.functional.pad(xb, (0, 0, 0, pad))
    out = torch.empty(m + pad, weight.shape[0], dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    if threads > MAX_THREADS:
        torch.set_num_threads(MAX_THREADS)
    try:
        for i in range(0, m + pad, BLOCK_ROWS):
            torch.mm(xb[i : i + BLOCK_ROWS], weight.t(), out=out[i : i + BLOCK_ROWS])
    finally:
        if threads > MAX_THREADS:
            torch.set_num_threads(threads)
    y = out[:m].float()
    if bias is not None:
        y += bias
    return y
