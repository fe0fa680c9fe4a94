"""``x @ W.T (+ bias)`` with W kept in a GGUF quantized format (Q4_1, Q8_0), dequantized in registers.

Decoding streams every weight once per step; a Q4_1 weight is 5 bits instead of float32's 32.
The kernels (``q4_1_gemm.c``, ``q8_0_gemm.c``, on the panel template ``panel_gemm.h``) take 1 to
any number of rows per call (up to 10 rows (AVX2: 4) held in registers, each dequantizing the
weights itself; more rows share one dequantized L1 tile per k-block: trees, batches), sum each
output exactly as the float32 packed kernel does, and the GGUF weights dequantize exactly to
float32, so a :class:`QuantLinear` returns bit for bit what :class:`~workers.kernels.packed_linear.
PackedLinear` returns on the dequantized weights, and every row's result is independent of the
other rows. Activations stay float32, except the prompt rows of a prefill on the bfloat16 path
(:meth:`QuantLinear.enable_bf16_prefill`, :mod:`workers.kernels.prefill_bf16`) and, when switched
on, every other row on the int8-activation path (:meth:`QuantLinear.enable_int8_activations`,
``vnni_gemm.h``: llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 dot products on AVX512-VNNI, or
``int8_avx2.c``, the same results on AVX2).
"""

from __future__ import annotations

import errno
import logging
import os
from functools import cache

import numpy as np
import torch

from workers.kernels import build
from workers.kernels.gguf_blocks import FORMATS, dequantize_panels, panels_from_blocks, reorder_for_vnni
from workers.kernels.prefill_bf16 import prefill_linear

log = logging.getLogger(__name__)

_ENTRY = {"Q4_1": "rd_linear_q4_1", "Q8_0": "rd_linear_q8_0"}
_INT8_ENTRY = {("vnni", "Q4_1"): "rd_linear_q4_1_vnni", ("vnni", "Q8_0"): "rd_linear_q8_0_vnni",
               ("amx", "Q4_1"): "rd_linear_q4_1_amx", ("amx", "Q8_0"): "rd_linear_q8_0_amx",
               ("avx2", "Q4_1"): "rd_linear_q4_1_int8_avx2", ("avx2", "Q8_0"): "rd_linear_q8_0_int8_avx2"}
INT8_CPU_FLAGS = {"avx512f", "avx512bw", "avx512_vnni"}  # vnni_gemm.h's instructions, as /proc/cpuinfo names them
AMX_CPU_FLAGS = INT8_CPU_FLAGS | {"amx_tile", "amx_int8"}  # amx_gemm.h's
INT8_KERNELS = ("amx", "vnni", "avx2")


def amx_unavailable() -> str | None:
    """Why the ``amx`` int8 kernel cannot run in this process (the CPU flags it lacks, AMX switched
    off with ``RDSERVE_AMX=0``, or Linux refusing the tile state), or None when it can. Asks Linux
    for the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, once per process) when the CPU has AMX.
    Like the vnni kernel, it is in both kernel builds (a ``target`` attribute), but only the AVX-512
    build chooses it by default (:func:`best_int8_kernel`)."""
    missing = build.missing_cpu_flags(AMX_CPU_FLAGS)
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if os.environ.get("RDSERVE_AMX", "1").strip().lower() in ("0", "off", "false", "no"):
        return "switched off by RDSERVE_AMX"
    return _amx_permission()


@cache
def _amx_permission() -> str | None:
    code = build.library(build.active_isa()).rd_amx_request()
    if not code:
        return None
    if code == -3:
        reason = "the kernel library was built without AMX (the compiler or assembler cannot build it)"
    elif code == -errno.EINVAL:
        reason = "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: EINVAL; needs Linux 5.16 or later)"
    elif code > -1000:
        reason = (f"Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: "
                  f"{errno.errorcode.get(-code, -code)}; a sandbox such as seccomp?)")
    else:
        reason = "Linux granted the AMX tile state but does not report it (arch_prctl ARCH_GET_XCOMP_PERM)"
    log.warning("%s: using the AVX512-VNNI int8 kernel", reason)
    return reason


def best_int8_kernel() -> str:
    """The int8-activation kernel of the compute path in use: ``"amx"`` (AMX tiles for row blocks
    of 10 rows or more on Q4_1 blocks, 8 on Q8_0, AVX512-VNNI below; ``int8_amx.c``) where :func:`amx_unavailable` finds nothing
    against it, else ``"vnni"`` (AVX512-VNNI) where the CPU has :data:`INT8_CPU_FLAGS` and the
    AVX-512 build is in use, else ``"avx2"`` (``int8_avx2.c``). All three give the same results bit
    for bit on finite activations. Forcing ``RDSERVE_CPU_ISA=avx2`` therefore runs no AVX-512
    instruction at all: the int8 kernel follows the build, so the path a replica names
    (``gguf-avx2-int8``) is the one that runs.

    Raises:
        KernelUnavailable: see :func:`~workers.kernels.build.active_isa`.
    """
    if build.missing_cpu_flags(INT8_CPU_FLAGS) or build.active_isa() != "avx512":
        return "avx2"
    return "vnni" if amx_unavailable() else "amx"


class QuantLinear(torch.nn.Module):
    """Inference-only linear layer on GGUF blocks: float32 ``[..., K] -> [..., N]`` on CPU.

    Args:
        fmt: ``"Q4_1"`` or ``"Q8_0"``.
        blocks: the GGUF tensor's data, uint8 ``[N, K / 32 * bytes per block]`` (rows in output
            order; see :mod:`workers.kernels.gguf_blocks`).
        in_features: K (a multiple of 32).
        bias: float32 ``[N]`` or None.
        tied_weight: a float32 ``[N, K]`` tensor equal to the dequantized weight (a tied input
            embedding) for :attr:`weight` to return instead of dequantizing.

    Raises:
        ValueError: an unsupported format, K not a multiple of 32, or shapes that do not match.
        KernelUnavailable: see :mod:`workers.kernels.build`.
    """

    def __init__(self, fmt: str, blocks: np.ndarray, in_features: int, bias: torch.Tensor | None = None,
                 tied_weight: torch.Tensor | None = None):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"unsupported weight format {fmt!r}; supported: {', '.join(FORMATS)}")
        if in_features % 32:
            raise ValueError(f"{fmt} needs in_features divisible by 32, got {in_features}")
        self.fmt, self.in_features, self.out_features = fmt, in_features, blocks.shape[0]
        self.register_buffer("panels", panels_from_blocks(fmt, np.asarray(blocks)), persistent=False)
        if self.panels.shape[1] != in_features // 32:
            raise ValueError(f"{fmt} blocks hold {self.panels.shape[1] * 32} columns, expected {in_features}")
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match {self.out_features} outputs")
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self._weight = tied_weight
        self.isa = build.load()  # fail here, not in the first forward
        self.prefill_weight: torch.Tensor | None = None  # bfloat16 [N, K] once enable_bf16_prefill()
        self.int8_activations = False  # True once enable_int8_activations()
        self.int8_kernel: str | None = None  # "amx", "vnni" or "avx2" once enable_int8_activations()
        self._entry = _ENTRY[fmt]

    def enable_bf16_prefill(self) -> None:
        """Keep a bfloat16 copy of the dequantized weight (2 bytes per weight) for prompt rows
        (``forward(x, prefill_rows)``; :mod:`workers.kernels.prefill_bf16`)."""
        self.prefill_weight = self.weight.detach().to(torch.bfloat16).contiguous()

    def enable_int8_activations(self, kernel: str | None = None) -> None:
        """From now on, compute the rows :meth:`forward` does not send to the bfloat16 prefill path
        with activations quantized to int8 (``int8_linear.h``; llama.cpp's Q8_1 activations): per row
        and block of 32 k, scale ``s = max|x| / 127`` (float32) and ``a = round(x / s)`` in
        ``[-127, 127]`` (``x * (1 / s)`` rounded half to even, as ``quantize_row_q8_1``). Each
        output is then ``sum_b s_b * sum_k w a`` over the k-blocks ``b`` in order, the inner sum
        exact in integers and rounded once to float32, then ``+ bias``. A row's result still depends
        on that row alone (not on M, its neighbours or the thread count), but no longer equals the
        float32 kernel's: the error is that of int8 activations (~0.5% of the output's norm with
        Gaussian activations; the tests measure it). Activations must be finite: a block holding a
        NaN gives NaN or finite outputs depending on the NaN's position and the kernel (the block
        maximum's ``maxps`` order), where a float32 row always gives NaN. Reorders the panels in place (same
        bytes per weight, :func:`~workers.kernels.gguf_blocks.reorder_for_vnni`); :attr:`weight` is
        unchanged. Idempotent; a second call may switch the kernel.

        kernel: ``"amx"`` (AMX ``TDPBSUD``, up to 8,192 products per instruction here, for row blocks
        of 10 rows or more on Q4_1, 8 on Q8_0, the vnni kernel below; ``amx_gemm.h``, ``int8_amx.c``), ``"vnni"`` (AVX512-VNNI ``vpdpbusd``, 64
        products per instruction; ``vnni_gemm.h``), ``"avx2"`` (``vpmaddubsw``, 32 per instruction;
        ``int8_avx2.c``), all the same bits on finite activations, or None for :func:`best_int8_kernel`.

        Raises:
            ValueError: an unknown kernel.
            KernelUnavailable: ``"vnni"`` on a CPU without AVX512-VNNI (or AVX512F / AVX512BW), or
                ``"amx"`` where :func:`amx_unavailable` gives a reason; the message names it.
        """
        kernel = kernel or best_int8_kernel()
        if kernel not in INT8_KERNELS:
            raise ValueError(f"int8 kernel must be one of {', '.join(INT8_KERNELS)}, got {kernel!r}")
        missing = build.missing_cpu_flags(INT8_CPU_FLAGS) if kernel == "vnni" else []
        if missing:
            raise build.KernelUnavailable(f"the vnni int8 kernel needs AVX512-VNNI; this CPU lacks {', '.join(missing)}")
        reason = amx_unavailable() if kernel == "amx" else None
        if reason:
            raise build.KernelUnavailable(f"the amx int8 kernel cannot run: {reason}")
        if not self.int8_activations:
            reorder_for_vnni(self.fmt, self.panels)
            self.int8_activations = True
        self.int8_kernel, self._entry = kernel, _INT8_ENTRY[kernel, self.fmt]

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized float32 weight ``[N, K]`` (a new tensor unless tied)."""
        if self._weight is not None:
            return self._weight
        return dequantize_panels(self.fmt, self.panels, self.out_features, vnni=self.int8_activations)

    def forward(self, x: torch.Tensor, prefill_rows: int | torch.Tensor = 0) -> torch.Tensor:
        """x: float32 ``[M, K]`` (or ``[..., K]``) -> ``[M, N]``. ``prefill_rows``: the prompt rows, a
        count of leading rows or ``[P] long`` row indices; with :meth:`enable_bf16_prefill` they take
        the bfloat16 GEMM, the others (decode steps, draft trees) these float32-activation kernels, or
        after :meth:`enable_int8_activations` the int8-activation kernel."""
        if self.prefill_weight is not None and (isinstance(prefill_rows, torch.Tensor) or prefill_rows):
            return self._split_forward(x, prefill_rows)
        # called ~120 times per decoding step: cheap checks, no reshape/view for 2-D contiguous input
        if x.dtype != torch.float32 or not x.is_cpu:
            raise ValueError(f"QuantLinear takes float32 CPU input, got {x.dtype} on {x.device}")
        panels = self._buffers["panels"]
        if panels.dtype != torch.uint8 or not panels.is_cpu:
            raise RuntimeError("QuantLinear blocks were moved or cast (.to/.half/...); they are CPU-only")
        return build.run_linear(build.kernel(self.isa, self._entry), x, panels, self.bias, self.in_features,
                                self.out_features)

    def _split_forward(self, x: torch.Tensor, rows: int | torch.Tensor) -> torch.Tensor:
        if not isinstance(rows, torch.Tensor):
            top = prefill_linear(x[:rows], self.prefill_weight, self.bias)
            return top if rows >= x.shape[0] else torch.cat([top, self.forward(x[rows:])])
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        if rows.numel():
            out[rows] = prefill_linear(x[rows], self.prefill_weight, self.bias)
        rest = torch.ones(x.shape[0], dtype=torch.bool)
        rest[rows] = False
        if bool(rest.any()):
            out[rest] = self.forward(x[rest].contiguous())
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """``state_dict()`` holds the dequantized ``weight`` (and ``bias``), as an ``nn.Linear``'s."""
        destination[prefix + "weight"] = self.weight.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def extra_repr(self) -> str:
        return (f"fmt={self.fmt}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8_activations={self.int8_activations}, int8_kernel={self.int8_kernel}")
