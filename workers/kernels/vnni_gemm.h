/* One template for GGUF weights times int8-quantized activations on AVX512-VNNI:
 * y[M, N] ~= x[M, K] @ W[N, K]^T (+ bias[N]); x [M, K], y [M, N] row-major float32, bias [N] or NULL.
 *
 * Source: llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 dot products (ggml-cpu, ggml_vec_dot_q4_1_q8_1,
 * ggml_vec_dot_q8_0_q8_0, quantize_row_q8_1), with the integer products on Intel's AVX512-VNNI
 * vpdpbusd (unsigned bytes times signed bytes, 4 products summed into each int32 lane; Intel SDM,
 * "VPDPBUSD").
 *
 * Activations, per row and per k-block b of 32 consecutive k, as llama.cpp's quantize_row_q8_1
 * (its block_q8_1, except that the scale and the sum stay float32 and int instead of float16):
 *   s[b] = max|x[k]| / 127 (float32),  a[k] = round(x[k] * (1 / s[b])) (int8, round half to even,
 *   clamped to [-127, 127]),  A[b] = sum_k a[k] (exact int).
 * A block whose s[b] is zero or subnormal (max|x| < 127 FLT_MIN, where 1 / s[b] would overflow)
 * gets s[b] = 0 and a = 0: it contributes nothing, and no NaN arises. Otherwise
 * |x * (1 / s)| <= 127 (1 + 2^-22) rounds to at most 127 and the clamp never acts.
 *
 * Weights: each format's blocks as shipped, the same bytes per weight, regrouped per panel of
 * PANEL = 32 output rows and k-block into the format's layout (q4_1_vnni.c, q8_0_vnni.c;
 * workers/kernels/gguf_blocks.py, reorder_for_vnni): per block the rows' float16 d[32] (Q4_1
 * also m[32]; Q8_0's m is -128 d), then the weights as unsigned integers q with w = d q + m (Q4_1:
 * its 4-bit q; Q8_0: qs + 128) in groups g of 4 consecutive k: one int32 lane per output row holds
 * its 4 bytes, vpdpbusd's unsigned operand, and the 4 bytes a[4 g .. 4 g + 3] broadcast to every
 * lane are its signed operand.
 *
 * Rounding: D = sum_k q a over a block is exact in int32 (|D| <= 32 * 255 * 127) and in float32
 * (< 2^24), as A is; m A is exact too (an 11-bit float16 times |A| <= 32 * 127 < 2^12). Each
 * output element is then, in float32 operations,
 *   total = 0;  for b in increasing order: total = fma(fma(d, D, m * A), s[b], total);  total + bias
 * i.e. each block's exact integer-weighted sum d D + m A = sum_k w a rounded once, times s[b]
 * added with one rounding, in a fixed order: the same for every row whatever M, the row block it
 * is computed in, the thread count or the kernel build, so a row's result never depends on the
 * other rows. The error against float32 activations is that of rounding each activation to 1/254
 * of its block's range (the tests measure it).
 *
 * The functions carry VNNI_TARGET, so both kernel builds contain them without -mavx512vnni and
 * still load on CPUs without AVX-512 or VNNI; only call them where the CPU has avx512f, avx512bw
 * and avx512_vnni (workers/kernels/quant_linear.py checks). K must be a multiple of 32.
 */
#ifndef RD_VNNI_GEMM_H
#define RD_VNNI_GEMM_H

#include <float.h>
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int8_linear.h"

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define PANEL 32
#define KBLOCK 32
#define ROWS 12             /* rows per register block: 24 int32 accumulators */
#define PREFETCH_BYTES 4096 /* software prefetch distance ahead of the weight stream */

enum { VNNI_Q4_1, VNNI_Q8_0 };

/* Blocks first..last - 1 of x (block i: row i / nb, k-block i % nb) -> a[i * 32 ..] int8,
 * scale[i] = s, asum[i] = A (see above). */
static VNNI_TARGET void quantize_blocks(const float *x, long first, long last, int8_t *a, float *scale, float *asum) {
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (long i = first; i < last; i++) {
        const float *xb = x + i * KBLOCK;
        int8_t *ab = a + i * KBLOCK;
        __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        float s = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1))) / 127.0f;
        if (s < FLT_MIN) {
            memset(ab, 0, KBLOCK);
            scale[i] = asum[i] = 0.0f;
            continue;
        }
        scale[i] = s;
        __m512 inv = _mm512_set1_ps(1.0f / s);
        __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x0, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x1, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q0 = _mm512_max_epi32(_mm512_min_epi32(q0, hi), lo);
        q1 = _mm512_max_epi32(_mm512_min_epi32(q1, hi), lo);
        _mm_storeu_si128((__m128i *)ab, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(ab + 16), _mm512_cvtepi32_epi8(q1));
        asum[i] = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

/* Bytes of one k-block of one panel: d[32] (and m[32]) float16, then 8 groups of 4 k. */
static inline int vnni_block_bytes(const int fmt) { return fmt == VNNI_Q4_1 ? 128 + 512 : 64 + 1024; }

/* The two 16-row vpdpbusd operands of group g of a block (rows 0-15, rows 16-31). */
static inline __attribute__((always_inline)) VNNI_TARGET void
group_operands(const int fmt, const uint8_t *blk, int g, __m512i *q0, __m512i *q1) {
    if (fmt == VNNI_Q4_1) { /* lane i: row i in the low nibbles, row 16 + i in the high ones */
        const __m512i nibble = _mm512_set1_epi8(0x0F);
        __m512i q = _mm512_loadu_si512(blk + 128 + 64 * g);
        *q0 = _mm512_and_si512(q, nibble);
        *q1 = _mm512_and_si512(_mm512_srli_epi16(q, 4), nibble);
    } else {
        *q0 = _mm512_loadu_si512(blk + 64 + 128 * g);
        *q1 = _mm512_loadu_si512(blk + 64 + 128 * g + 64);
    }
}

/* A block's weight scales d and minimums m for the panel's rows 0-15 (d0, m0) and 16-31 (d1, m1). */
static inline __attribute__((always_inline)) VNNI_TARGET void
block_scales(const int fmt, const uint8_t *blk, __m512 *d0, __m512 *d1, __m512 *m0, __m512 *m1) {
    *d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    *d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk + 1));
    if (fmt == VNNI_Q4_1) {
        *m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk + 2));
        *m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk + 3));
    } else { /* q = w + 128: m = -128 d, exact */
        *m0 = _mm512_mul_ps(*d0, _mm512_set1_ps(-128.0f));
        *m1 = _mm512_mul_ps(*d1, _mm512_set1_ps(-128.0f));
    }
}

/* One row's block: total[0..31] = fma(fma(d, D, m * A), s, total) with its integer sums D0, D1
 * (columns 0-15, 16-31), activation scale s and sum A (the header's rounding, the same for every
 * kernel that computes D). */
static inline __attribute__((always_inline)) VNNI_TARGET void
add_block(float *total, __m512i D0, __m512i D1, float s, float A, __m512 d0, __m512 d1, __m512 m0, __m512 m1) {
    __m512 vs = _mm512_set1_ps(s), sa = _mm512_set1_ps(A);
    __m512 c0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(D0), _mm512_mul_ps(m0, sa));
    __m512 c1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(D1), _mm512_mul_ps(m1, sa));
    _mm512_store_ps(total, _mm512_fmadd_ps(c0, vs, _mm512_load_ps(total)));
    _mm512_store_ps(total + 16, _mm512_fmadd_ps(c1, vs, _mm512_load_ps(total + 16)));
}

/* rows rows of total ([row][PANEL]), + bias when not NULL, into y (row stride ldy, nvalid columns). */
static inline void store_rows(int rows, float (*total)[PANEL], const float *bias, float *y, long ldy, long nvalid) {
    for (int m = 0; m < rows; m++) {
        if (bias)
            for (long j = 0; j < nvalid; j++) total[m][j] += bias[j];
        memcpy(y + m * ldy, total[m], (size_t)nvalid * sizeof(float));
    }
}

/* MR quantized rows (a: stride K; scale, asum: stride K / 32) times one panel w into y (row
 * stride ldy, first nvalid columns). */
static inline __attribute__((always_inline)) VNNI_TARGET void
vnni_rows(const int fmt, const int MR, const int8_t *a, const float *scale, const float *asum, long K,
          const uint8_t *w, const float *bias, float *y, long ldy, long nvalid) {
    const long nb = K / KBLOCK;
    const int block_bytes = vnni_block_bytes(fmt);
    float total[ROWS][PANEL] __attribute__((aligned(64)));
    memset(total, 0, (size_t)MR * sizeof(total[0]));
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * block_bytes;
        for (int line = 0; line < block_bytes; line += 64)
            _mm_prefetch((const char *)blk + PREFETCH_BYTES + line, _MM_HINT_T0);
        __m512i dot[ROWS][2];
        for (int m = 0; m < MR; m++) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int g = 0; g < KBLOCK / 4; g++) {
            __m512i q0, q1;
            group_operands(fmt, blk, g, &q0, &q1);
            for (int m = 0; m < MR; m++) {
                int32_t four;
                memcpy(&four, a + m * K + b * KBLOCK + 4 * g, 4);
                __m512i av = _mm512_set1_epi32(four);
                dot[m][0] = _mm512_dpbusd_epi32(dot[m][0], q0, av);
                dot[m][1] = _mm512_dpbusd_epi32(dot[m][1], q1, av);
            }
        }
        __m512 d0, d1, m0, m1;
        block_scales(fmt, blk, &d0, &d1, &m0, &m1);
        for (int m = 0; m < MR; m++)
            add_block(total[m], dot[m][0], dot[m][1], scale[m * nb + b], asum[m * nb + b], d0, d1, m0, m1);
    }
    store_rows(MR, total, bias, y, ldy, nvalid);
}

typedef int8_kernel vnni_kernel;

/* NAME##_k1 .. NAME##_k12: vnni_rows for FMT with 1..12 rows, and NAME##_kernels[1..12]. */
#define VNNI_KERNEL(NAME, FMT, MR)                                                                          \
    static VNNI_TARGET void NAME##_k##MR(const int8_t *a, const float *scale, const float *asum, long K,      \
                                         const uint8_t *w, const float *bias, float *y, long ldy, long nvalid) { \
        vnni_rows(FMT, MR, a, scale, asum, K, w, bias, y, ldy, nvalid); }
#define VNNI_KERNELS(NAME, FMT)                                                                             \
    VNNI_KERNEL(NAME, FMT, 1) VNNI_KERNEL(NAME, FMT, 2) VNNI_KERNEL(NAME, FMT, 3) VNNI_KERNEL(NAME, FMT, 4)   \
    VNNI_KERNEL(NAME, FMT, 5) VNNI_KERNEL(NAME, FMT, 6) VNNI_KERNEL(NAME, FMT, 7) VNNI_KERNEL(NAME, FMT, 8)   \
    VNNI_KERNEL(NAME, FMT, 9) VNNI_KERNEL(NAME, FMT, 10) VNNI_KERNEL(NAME, FMT, 11) VNNI_KERNEL(NAME, FMT, 12) \
    static const vnni_kernel NAME##_kernels[ROWS + 1] = {NULL, NAME##_k1, NAME##_k2, NAME##_k3, NAME##_k4,      \
        NAME##_k5, NAME##_k6, NAME##_k7, NAME##_k8, NAME##_k9, NAME##_k10, NAME##_k11, NAME##_k12};

/* A format's entry (int8_linear.h). */
static inline int vnni_linear(const int fmt, const vnni_kernel *kernels, const float *x, const void *w,
                              const float *bias, float *y, long M, long K, long N) {
    return int8_linear(quantize_blocks, kernels, ROWS, (size_t)vnni_block_bytes(fmt), x, w, bias, y, M, K, N);
}

#endif
