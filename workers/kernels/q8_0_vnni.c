/* GGUF Q8_0 weights times int8-quantized activations on AVX512-VNNI (vnni_gemm.h):
 * y[M, N] ~= x[M, K] @ W[N, K]^T (+ bias[N]).
 *
 * ggml's Q8_0 block (float16 d, int8 qs[32]; w = d qs, see q8_0_gemm.c) as shipped, 8.5 bits per
 * weight, regrouped per panel of 32 rows by workers/kernels/gguf_blocks.py (panels_from_blocks,
 * then reorder_for_vnni). vpdpbusd multiplies unsigned by signed bytes and the activations are
 * signed, so each weight is stored as the unsigned q = qs + 128 (0..255; the sign bit flipped) and
 * the template's m = -128 d: d q + m = d qs, and m A stays exact (llama.cpp's AVX2 Q8_0 path moves
 * the signs onto the activations instead, an operation per row). Panel p, k-block b (1088 bytes),
 * for the panel's rows j = 0..31 and i = 0..15:
 *
 *   uint16 d[32]          d of row 32 p + j, block b
 *   uint8  q[8][2][16][4] q[g][h][i][t]: qs + 128 of row 32 p + 16 h + i at k = 32 b + 4 g + t
 *
 * so group g is two 64-byte vectors (rows 0-15, rows 16-31) whose int32 lane i holds 4 consecutive
 * k of one row: vpdpbusd's unsigned operands as loaded.
 */
#include "vnni_gemm.h"

VNNI_KERNELS(q8_0_vnni, VNNI_Q8_0)

/* x: [M, K]; w: [ceil(N / 32)][K / 32][1088] bytes as above; bias: [N] or NULL; y: [M, N].
 * Returns 0, or -1 when out of memory (vnni_linear). */
int rd_linear_q8_0_vnni(const float *x, const void *w, const float *bias, float *y, long M, long K, long N) {
    return vnni_linear(VNNI_Q8_0, q8_0_vnni_kernels, x, w, bias, y, M, K, N);
}
