/* GGUF Q4_1 weights times int8-quantized activations on AVX512-VNNI (vnni_gemm.h):
 * y[M, N] ~= x[M, K] @ W[N, K]^T (+ bias[N]).
 *
 * ggml's Q4_1 block (float16 d, float16 m, 16 bytes of 4-bit q; w = d q + m, q = 0..15, see
 * q4_1_gemm.c) as shipped, 5 bits per weight, regrouped per panel of 32 rows by
 * workers/kernels/gguf_blocks.py (panels_from_blocks, then reorder_for_vnni). Panel p, k-block b
 * (640 bytes), for the panel's rows j = 0..31 and i = 0..15:
 *
 *   uint16 d[32]        d of row 32 p + j, block b
 *   uint16 m[32]        m of row 32 p + j, block b
 *   uint8  q[8][16][4]  q[g][i][t]: q of row 32 p + i (low 4 bits) and of row 32 p + 16 + i
 *                       (high 4 bits) at k = 32 b + 4 g + t
 *
 * so group g is one 64-byte vector whose int32 lane i holds rows i and 16 + i at 4 consecutive k:
 * masking its low and high nibbles gives vpdpbusd's unsigned operands for rows 0-15 and 16-31.
 */
#include "vnni_gemm.h"

VNNI_KERNELS(q4_1_vnni, VNNI_Q4_1)

/* x: [M, K]; w: [ceil(N / 32)][K / 32][640] bytes as above; bias: [N] or NULL; y: [M, N].
 * Returns 0, or -1 when out of memory (vnni_linear). */
int rd_linear_q4_1_vnni(const float *x, const void *w, const float *bias, float *y, long M, long K, long N) {
    return vnni_linear(VNNI_Q4_1, q4_1_vnni_kernels, x, w, bias, y, M, K, N);
}
