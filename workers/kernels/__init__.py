"""Hand-written CPU kernels for the engine's hot path, built with the system C compiler on first
use (AVX-512 and AVX2+FMA builds, chosen by the CPU's flags; :mod:`workers.kernels.build`), with a
torch fallback:

- :mod:`workers.kernels.packed_linear`: float32 weights packed in panels (``packed_gemm.c``);
- :mod:`workers.kernels.quant_linear`: GGUF Q4_1 / Q8_0 blocks as shipped, dequantized in registers
  (``q4_1_gemm.c``, ``q8_0_gemm.c``; block layouts in :mod:`workers.kernels.gguf_blocks`), or, when
  switched on, times int8-quantized activations on AVX512-VNNI (``vnni_gemm.h``: ``q4_1_vnni.c``,
  ``q8_0_vnni.c``);
- :mod:`workers.kernels.rms_norm`: residual add + RMSNorm (``rms_norm.c``);
- :mod:`workers.kernels.decode_attention`: RoPE + KV-cache write (``rope_kv.c``) and attention of
  decode steps and draft trees straight from the paged cache (``decode_attention.c``).

The GEMMs share one template (``panel_gemm.h``), all kernels the vector operations in ``simd.h``,
and one rounding rule: each row's result is independent of the other rows and identical on both
builds, and a quantized layer returns the float32 kernel's bits on its dequantized weights (with
int8 activations: the exact integer block sums, scaled in a fixed order, also row-independent).
"""
