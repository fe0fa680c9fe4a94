"""Hand-written CPU kernels for the engine's hot path, built with the system C compiler on first
use (AVX-512 and AVX2+FMA builds, chosen by the CPU's flags; :mod:`workers.kernels.build`), with a
torch fallback:

- :mod:`workers.kernels.packed_linear`: float32 weights packed in panels (``packed_gemm.c``);
- :mod:`workers.kernels.quant_linear`: GGUF Q4_1 / Q8_0 blocks as shipped, dequantized in registers
  (``q4_1_gemm.c``, ``q8_0_gemm.c``; block layouts in :mod:`workers.kernels.gguf_blocks`).

All share one template (``panel_gemm.h``, vector operations in ``simd.h``) and one rounding: each
row's result is independent of the other rows, identical on both builds, and a quantized layer
returns the float32 kernel's bits on its dequantized weights.
"""
