/* GGUF Q4_1 weights, dequantized in registers: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]).
 *
 * ggml's Q4_1 block (ggml-common.h block_q4_1, 20 bytes for 32 consecutive k of one row):
 * float16 d, float16 m, 16 bytes qs; weight i = d * q_i + m with q_i = qs[i] & 15 for i < 16 and
 * qs[i - 16] >> 4 for i >= 16. The blocks' values are kept as shipped (no requantization); they
 * are only regrouped by panels of 32 rows (workers/kernels/gguf_blocks.py), the same 5 bits per
 * weight. Panel p, k-block b (Q4_1_PANEL_BLOCK = 640 bytes), for the panel's rows j = 0..31:
 *
 *   uint16 d[32]     d of row 32 p + j, block b
 *   uint16 m[32]     m of row 32 p + j, block b
 *   uint8  q[32][16] q[kk][i] = q of row 32 p + i at k = 32 b + kk (low 4 bits), of row
 *                    32 p + 16 + i (high 4 bits)
 *
 * K must be a multiple of 32. d * q is exact in float32 (an 11-bit by 4-bit product), so the FMA
 * d * q + m rounds once, as float32 d * q + m does: the weights equal ggml's / gguf-py's float32
 * dequantization bit for bit, and so do the results those of the float32 kernel on them.
 */
#include "panel_gemm.h"

#if VL == 16 /* rows held in registers (measured best up to 10); more rows take the tiled path */
#define ROWS 10
#else
#define ROWS 4
#endif

ROW_KERNELS(q4_1, FMT_Q4_1)

/* x: [M, K]; w: [ceil(N / 32)][K / 32][640] bytes as above; bias: [N] or NULL; y: [M, N]. */
void rd_linear_q4_1(const float *x, const void *w, const float *bias, float *y, long M, long K, long N) {
    quant_linear(FMT_Q4_1, q4_1_kernels, ROWS, Q4_1_PANEL_BLOCK, x, w, bias, y, M, K, N);
}
