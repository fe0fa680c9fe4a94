/* GGUF Q4_1 / Q8_0 weights times int8-quantized activations on AVX2: the same computation as the
 * AVX512-VNNI kernels (vnni_gemm.h), bit for bit for finite activations (int8_linear.h), for CPUs
 * without VNNI (most laptops, AMD Zen 2/3).
 *
 * Same weight layout (q4_1_vnni.c, q8_0_vnni.c: workers/kernels/gguf_blocks.py, reorder_for_vnni),
 * same quantized activations (int8_linear.h), same float32 operations per output:
 *   total = 0;  for b in increasing order: total = fma(fma(d, D, m * A), s[b], total);  total + bias
 * with D = sum_k q a over block b exact in int32. Only the integer products differ:
 *
 * - Q4_1 (q = 0..15 unsigned): vpmaddubsw multiplies unsigned by signed bytes and adds neighbouring
 *   pairs into int16 (|q a + q' a'| <= 2 * 15 * 127 = 3810); the 8 groups of a block are added in
 *   int16 (|sum| <= 30480 < 2^15, no saturation) and vpmaddwd with ones widens each lane's two
 *   int16 to its int32 D.
 * - Q8_0 (stored q = qs + 128 for vpdpbusd): 255 * 127 * 2 would saturate vpmaddubsw, so, as
 *   llama.cpp's AVX2 Q8_0 dot product does, the kernel takes |qs| as the unsigned operand and moves
 *   qs's sign onto the activation (vpsignb; |a| <= 127, so no overflow): pairs stay within
 *   2 * 128 * 127 = 32512, widened per group with vpmaddwd. That sums D' = sum qs a; the VNNI kernel
 *   sums D = sum q a = D' + 128 A with m = -128 d, and fma(d, D, m A) and fma(d, D', 0 * A) both
 *   round the same exact value d D' once, so the results are the same bits.
 *
 * Q8_0 (int8_rows): a panel's 32 output rows are done in two halves of 16 (the first, then the
 * second 64 bytes of each group), two int accumulators per activation row, up to ROWS_Q8_0_AVX2 rows.
 * Q4_1 (q4_1_rows_q): in four quarters of 8 (low nibbles, then high), one accumulator per row, up to
 * ROWS_Q4_1_AVX2 rows in the 16 ymm registers beside the weights, the broadcast and a product. With
 * two accumulators per row and 6 rows GCC spilled accumulators and hoisted broadcasts to the stack
 * inside the inner loop; the quarters reuse each broadcast 4 times from L1 and keep 8 rows in
 * registers (one thread, the default model's 30 layers: 16 rows 39.8 -> 30.2 ms, 7 rows 18.4 -> 15.3;
 * BENCHMARKS.md "Stop 28"). Every output sums the same products in the same order either way.
 */
#include <float.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "int8_linear.h"

#define ROWS_AVX2 8      /* the most rows a kernel takes (its total[] buffer) */
#define ROWS_Q4_1_AVX2 8 /* rows per call: Q4_1 keeps one accumulator per row (q4_1_rows_q) */
#define ROWS_Q8_0_AVX2 6 /* Q8_0 two (int8_rows) */
#define PREFETCH_AVX2 4096
#define Q4_1_BLOCK 640  /* d[32], m[32] float16, q[8][16][4] nibble pairs (q4_1_vnni.c) */
#define Q8_0_BLOCK 1088 /* d[32] float16, q[8][2][16][4] (q8_0_vnni.c) */

enum { I8_Q4_1, I8_Q8_0 };

/* int8_linear.h's quantization, on AVX2: the same float32 operations as vnni_gemm.h's. */
static void quantize_avx2(const float *x, long first, long last, int8_t *a, float *scale, float *asum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (long i = first; i < last; i++) {
        const float *xb = x + i * INT8_KBLOCK;
        int8_t *ab = a + i * INT8_KBLOCK;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float s = _mm_cvtss_f32(m4) / 127.0f;
        if (s < FLT_MIN) {
            memset(ab, 0, INT8_KBLOCK);
            scale[i] = asum[i] = 0.0f;
            continue;
        }
        scale[i] = s;
        const __m256 inv = _mm256_set1_ps(1.0f / s);
        __m256i q[4], total = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(r), hi), lo);
            total = _mm256_add_epi32(total, q[j]);
        }
        /* packs interleave 128-bit lanes: the bytes come out as dwords 0 4 1 5 2 6 3 7 */
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)ab, _mm256_permutevar8x32_epi32(bytes, order));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        asum[i] = (float)_mm_cvtsi128_si32(t);
    }
}

/* y[m, 0 .. nvalid) = total[m] (+ bias) for the MR rows of a panel. */
static inline __attribute__((always_inline)) void
store_rows(const int MR, float total[][INT8_PANEL], const float *bias, float *y, long ldy, long nvalid) {
    for (int m = 0; m < MR; m++) {
        if (bias)
            for (long j = 0; j < nvalid; j++) total[m][j] += bias[j];
        memcpy(y + m * ldy, total[m], (size_t)nvalid * sizeof(float));
    }
}

/* The two unsigned operands (8 rows each) of group g for half h of a block: Q4_1's nibbles, or Q8_0's
 * |qs| with qs itself in *sgn (for vpsignb). */
static inline __attribute__((always_inline)) void
operands(const int fmt, const uint8_t *blk, int g, int h, __m256i u[2], __m256i sgn[2]) {
    if (fmt == I8_Q4_1) {
        const __m256i nibble = _mm256_set1_epi8(0x0F);
        for (int j = 0; j < 2; j++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 128 + 64 * g + 32 * j));
            u[j] = _mm256_and_si256(h ? _mm256_srli_epi16(q, 4) : q, nibble);
        }
    } else {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        for (int j = 0; j < 2; j++) {
            sgn[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 64 + 128 * g + 64 * h + 32 * j)), flip);
            u[j] = _mm256_abs_epi8(sgn[j]);
        }
    }
}

static inline __attribute__((always_inline)) void
int8_rows(const int fmt, const int MR, const int8_t *a, const float *scale, const float *asum, long K,
          const uint8_t *w, const float *bias, float *y, long ldy, long nvalid) {
    const long nb = K / INT8_KBLOCK;
    const int block_bytes = fmt == I8_Q4_1 ? Q4_1_BLOCK : Q8_0_BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    float total[ROWS_AVX2][INT8_PANEL] __attribute__((aligned(32)));
    memset(total, 0, (size_t)MR * sizeof(total[0]));
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * block_bytes;
        for (int line = 0; line < block_bytes; line += 64)
            _mm_prefetch((const char *)blk + PREFETCH_AVX2 + line, _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            __m256i dot[ROWS_AVX2][2];
            for (int m = 0; m < MR; m++) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int g = 0; g < INT8_KBLOCK / 4; g++) {
                __m256i u[2], sgn[2];
                operands(fmt, blk, g, h, u, sgn);
                for (int m = 0; m < MR; m++) {
                    int32_t four;
                    memcpy(&four, a + m * K + b * INT8_KBLOCK + 4 * g, 4);
                    const __m256i av = _mm256_set1_epi32(four);
                    for (int j = 0; j < 2; j++) {
                        if (fmt == I8_Q4_1) { /* int16 sums over the block's groups */
                            dot[m][j] = _mm256_add_epi16(dot[m][j], _mm256_maddubs_epi16(u[j], av));
                        } else {
                            __m256i p = _mm256_maddubs_epi16(u[j], _mm256_sign_epi8(av, sgn[j]));
                            dot[m][j] = _mm256_add_epi32(dot[m][j], _mm256_madd_epi16(p, ones));
                        }
                    }
                }
            }
            /* rows 16 h + 8 j .. + 7 of the panel */
            const uint16_t *dh = (const uint16_t *)blk + 16 * h;
            __m256 d[2], mm[2];
            for (int j = 0; j < 2; j++) {
                d[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dh + 8 * j)));
                mm[j] = fmt == I8_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dh + 32 + 8 * j)))
                                       : _mm256_setzero_ps();
            }
            for (int m = 0; m < MR; m++) {
                const __m256 s = _mm256_set1_ps(scale[m * nb + b]), sa = _mm256_set1_ps(asum[m * nb + b]);
                for (int j = 0; j < 2; j++) {
                    __m256i D = fmt == I8_Q4_1 ? _mm256_madd_epi16(dot[m][j], ones) : dot[m][j];
                    __m256 c = _mm256_fmadd_ps(d[j], _mm256_cvtepi32_ps(D), _mm256_mul_ps(mm[j], sa));
                    float *t = total[m] + 16 * h + 8 * j;
                    _mm256_store_ps(t, _mm256_fmadd_ps(c, s, _mm256_load_ps(t)));
                }
            }
        }
    }
    store_rows(MR, total, bias, y, ldy, nvalid);
}

/* One block's products for 8 outputs (quarter 2 h + j of a Q4_1 panel: low, then high nibbles) and MR
 * rows: one int accumulator per row, so up to ROWS_AVX2 rows stay in registers with the weights, the
 * broadcast and a product. */
static inline __attribute__((always_inline)) void
q4_1_rows_q(const int MR, const int8_t *a, const float *scale, const float *asum, long K, const uint8_t *w,
            const float *bias, float *y, long ldy, long nvalid) {
    const long nb = K / INT8_KBLOCK;
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
    float total[ROWS_AVX2][INT8_PANEL] __attribute__((aligned(32)));
    memset(total, 0, (size_t)MR * sizeof(total[0]));
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * Q4_1_BLOCK;
        const int8_t *ab = a + b * INT8_KBLOCK;
        for (int line = 0; line < Q4_1_BLOCK; line += 64)
            _mm_prefetch((const char *)blk + PREFETCH_AVX2 + line, _MM_HINT_T0);
        for (int hj = 0; hj < 4; hj++) {
            const int h = hj >> 1, j = hj & 1;
            __m256i dot[ROWS_AVX2];
            for (int m = 0; m < MR; m++) dot[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int g = 0; g < INT8_KBLOCK / 4; g++) {
                __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 128 + 64 * g + 32 * j));
                const __m256i u = _mm256_and_si256(h ? _mm256_srli_epi16(q, 4) : q, nibble);
                for (int m = 0; m < MR; m++) { /* int16 sums over the block's groups */
                    int32_t four;
                    memcpy(&four, ab + m * K + 4 * g, 4);
                    dot[m] = _mm256_add_epi16(dot[m], _mm256_maddubs_epi16(u, _mm256_set1_epi32(four)));
                }
            }
            /* rows 16 h + 8 j .. + 7 of the panel */
            const uint16_t *dh = (const uint16_t *)blk + 16 * h + 8 * j;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh));
            const __m256 mm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dh + 32)));
            for (int m = 0; m < MR; m++) {
                const __m256 s = _mm256_set1_ps(scale[m * nb + b]), sa = _mm256_set1_ps(asum[m * nb + b]);
                __m256 c = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[m], ones)), _mm256_mul_ps(mm, sa));
                float *t = total[m] + 8 * hj;
                _mm256_store_ps(t, _mm256_fmadd_ps(c, s, _mm256_load_ps(t)));
            }
        }
    }
    store_rows(MR, total, bias, y, ldy, nvalid);
}

#define I8_KERNEL(NAME, FMT, MR)                                                                              \
    static void NAME##_k##MR(const int8_t *a, const float *scale, const float *asum, long K, const uint8_t *w, \
                             const float *bias, float *y, long ldy, long nvalid) {                            \
        if (FMT == I8_Q4_1) q4_1_rows_q(MR, a, scale, asum, K, w, bias, y, ldy, nvalid);                     \
        else int8_rows(FMT, MR, a, scale, asum, K, w, bias, y, ldy, nvalid); }
#define I8_KERNELS(NAME, FMT)                                                                                 \
    I8_KERNEL(NAME, FMT, 1) I8_KERNEL(NAME, FMT, 2) I8_KERNEL(NAME, FMT, 3) I8_KERNEL(NAME, FMT, 4)           \
    I8_KERNEL(NAME, FMT, 5) I8_KERNEL(NAME, FMT, 6) I8_KERNEL(NAME, FMT, 7) I8_KERNEL(NAME, FMT, 8)           \
    static const int8_kernel NAME##_kernels[ROWS_AVX2 + 1] = {NULL, NAME##_k1, NAME##_k2, NAME##_k3,           \
                                                              NAME##_k4, NAME##_k5, NAME##_k6, NAME##_k7, NAME##_k8};

I8_KERNELS(q4_1_i8, I8_Q4_1)
I8_KERNELS(q8_0_i8, I8_Q8_0)

/* x: [M, K]; w: the panels of q4_1_vnni.c / q8_0_vnni.c; bias: [N] or NULL; y: [M, N].
 * Return 0, or -1 when out of memory (int8_linear.h). */
int rd_linear_q4_1_int8_avx2(const float *x, const void *w, const float *bias, float *y, long M, long K, long N) {
    return int8_linear(quantize_avx2, q4_1_i8_kernels, ROWS_Q4_1_AVX2, Q4_1_BLOCK, x, w, bias, y, M, K, N);
}

int rd_linear_q8_0_int8_avx2(const float *x, const void *w, const float *bias, float *y, long M, long K, long N) {
    return int8_linear(quantize_avx2, q8_0_i8_kernels, ROWS_Q8_0_AVX2, Q8_0_BLOCK, x, w, bias, y, M, K, N);
}
