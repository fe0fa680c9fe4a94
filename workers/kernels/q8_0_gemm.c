/* GGUF Q8_0 weights, dequantized in registers: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]).
 *
 * ggml's Q8_0 block (ggml-common.h block_q8_0, 34 bytes for 32 consecutive k of one row):
 * float16 d, int8 qs[32]; weight i = d * qs[i]. Values kept as shipped, regrouped by panels of 32
 * rows (workers/kernels/gguf_blocks.py), 8.5 bits per weight. Panel p, k-block b
 * (Q8_0_PANEL_BLOCK = 1088 bytes), for the panel's rows j = 0..31:
 *
 *   uint16 d[32]     d of row 32 p + j, block b
 *   int8   q[32][32] q[kk][j] = qs of row 32 p + j at k = 32 b + kk
 *
 * K must be a multiple of 32. d * q is exact in float32 (an 11-bit by 8-bit product): the weights
 * equal the float32 dequantization bit for bit, and so do the results the float32 kernel's.
 */
#include "panel_gemm.h"

#if VL == 16 /* rows held in registers (measured best up to 10); more rows take the tiled path */
#define ROWS 10
#else
#define ROWS 4
#endif

ROW_KERNELS(q8_0, FMT_Q8_0)

/* x: [M, K]; w: [ceil(N / 32)][K / 32][1088] bytes as above; bias: [N] or NULL; y: [M, N]. */
void rd_linear_q8_0(const float *x, const void *w, const float *bias, float *y, long M, long K, long N) {
    quant_linear(FMT_Q8_0, q8_0_kernels, ROWS, Q8_0_PANEL_BLOCK, x, w, bias, y, M, K, N);
}
