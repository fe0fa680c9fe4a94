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
 * Register blocking (both formats): the inner loop over a block's 8 groups of 4 K-values is written
 * in asm per row (a broadcast load of the row's 4 activations, then its products and adds), as GCC
 * otherwise loads every row's broadcast ahead of the products (or hoists them all out of the loop
 * over the panel's quarters) and spills accumulators to the stack.
 * - Q4_1 (q4_1_rows_h): a panel's 32 outputs in two halves j of 16: the low and the high nibbles of
 *   the same 32 weight bytes (outputs 8 j .. + 7 and 16 + 8 j .. + 7), two int16 accumulators per row,
 *   so each broadcast serves two products and each weight load 2 * MR; up to ROWS_Q4_1_AVX2 rows
 *   (12 accumulators, the two operands and two temporaries fill the 16 ymm registers).
 * - Q8_0 (q8_0_rows_q): in four quarters of 8 outputs, one int32 accumulator per row (vpsignb,
 *   vpmaddubsw, vpmaddwd, vpaddd per row and group), up to ROWS_Q8_0_AVX2 rows.
 * Against the kernels before (GCC's spills; Q8_0 with two accumulators per row): 1.17x on the default
 * model's shapes at 16 rows (benchmarks/int8_activations.py, BENCHMARKS.md section 16). Every output
 * sums the same products in the same order either way.
 */
#include <float.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "int8_linear.h"

#define ROWS_AVX2 8      /* the most rows a kernel takes (its total[] buffer) */
#define ROWS_Q4_1_AVX2 6 /* rows per call: Q4_1 keeps two accumulators per row (q4_1_rows_h) */
#define ROWS_Q8_0_AVX2 8 /* Q8_0 one (q8_0_rows_q) */
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

/* One block's products for the 16 outputs of half j of a Q4_1 panel (the low and the high nibbles of
 * the same bytes: outputs 8 j .. + 7 and 16 + 8 j .. + 7) and MR rows: two int16 accumulators per row,
 * so each activation broadcast serves two products and each weight load four row-products. */
static inline __attribute__((always_inline)) void
q4_1_rows_h(const int MR, const int8_t *a, const float *scale, const float *asum, long K, const uint8_t *w,
            const float *bias, float *y, long ldy, long nvalid) {
    const long nb = K / INT8_KBLOCK;
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
    float total[ROWS_AVX2][INT8_PANEL] __attribute__((aligned(32)));
    memset(total, 0, (size_t)MR * sizeof(total[0]));
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * Q4_1_BLOCK;
        for (int line = 0; line < Q4_1_BLOCK; line += 64)
            _mm_prefetch((const char *)blk + PREFETCH_AVX2 + line, _MM_HINT_T0);
        for (int j = 0; j < 2; j++) {
            const int8_t *ab = a + b * INT8_KBLOCK;
            __asm__("" : "+r"(ab)); /* reload the broadcasts for each half (else GCC keeps all on the stack) */
            __m256i lo[ROWS_AVX2], hi[ROWS_AVX2];
            for (int m = 0; m < MR; m++) lo[m] = hi[m] = _mm256_setzero_si256();
#pragma GCC unroll 1
            for (int g = 0; g < INT8_KBLOCK / 4; g++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 128 + 64 * g + 32 * j));
                const __m256i ul = _mm256_and_si256(q, nibble), uh = _mm256_and_si256(_mm256_srli_epi16(q, 4), nibble);
                for (int m = 0; m < MR; m++) { /* int16 sums over the block's groups */
                    /* one broadcast, then both products: in asm, as GCC otherwise loads every row's
                     * broadcast first and spills the accumulators */
                    __m256i t, p;
                    __asm__("vpbroadcastd %[a], %[t]\n\t"
                            "vpmaddubsw %[t], %[ul], %[p]\n\t"
                            "vpaddw %[p], %[lo], %[lo]\n\t"
                            "vpmaddubsw %[t], %[uh], %[t]\n\t"
                            "vpaddw %[t], %[hi], %[hi]"
                            : [lo] "+x"(lo[m]), [hi] "+x"(hi[m]), [t] "=&x"(t), [p] "=&x"(p)
                            : [a] "m"(*(const int32_t *)(ab + m * K + 4 * g)), [ul] "x"(ul), [uh] "x"(uh));
                }
            }
            for (int h = 0; h < 2; h++) { /* rows 16 h + 8 j .. + 7 of the panel */
                const uint16_t *dh = (const uint16_t *)blk + 16 * h + 8 * j;
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh));
                const __m256 mm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dh + 32)));
                for (int m = 0; m < MR; m++) {
                    const __m256 s = _mm256_set1_ps(scale[m * nb + b]), sa = _mm256_set1_ps(asum[m * nb + b]);
                    const __m256i D = _mm256_madd_epi16(h ? hi[m] : lo[m], ones);
                    __m256 c = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(D), _mm256_mul_ps(mm, sa));
                    float *t = total[m] + 16 * h + 8 * j;
                    _mm256_store_ps(t, _mm256_fmadd_ps(c, s, _mm256_load_ps(t)));
                }
            }
        }
    }
    store_rows(MR, total, bias, y, ldy, nvalid);
}

/* One block's products for 8 outputs (quarter 2 h + j of a Q8_0 panel) and MR rows: one int32
 * accumulator per row; |qs| is the unsigned operand and qs's sign moves onto the activation. */
static inline __attribute__((always_inline)) void
q8_0_rows_q(const int MR, const int8_t *a, const float *scale, const float *asum, long K, const uint8_t *w,
            const float *bias, float *y, long ldy, long nvalid) {
    const long nb = K / INT8_KBLOCK;
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    float total[ROWS_AVX2][INT8_PANEL] __attribute__((aligned(32)));
    (void)asum;
    memset(total, 0, (size_t)MR * sizeof(total[0]));
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * Q8_0_BLOCK;
        for (int line = 0; line < Q8_0_BLOCK; line += 64)
            _mm_prefetch((const char *)blk + PREFETCH_AVX2 + line, _MM_HINT_T0);
        for (int hj = 0; hj < 4; hj++) {
            const int h = hj >> 1, j = hj & 1;
            const int8_t *ab = a + b * INT8_KBLOCK;
            __asm__("" : "+r"(ab));
            __m256i dot[ROWS_AVX2];
            for (int m = 0; m < MR; m++) dot[m] = _mm256_setzero_si256();
#pragma GCC unroll 1
            for (int g = 0; g < INT8_KBLOCK / 4; g++) {
                const __m256i sgn = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 64 + 128 * g + 64 * h + 32 * j)), flip);
                const __m256i u = _mm256_abs_epi8(sgn);
                for (int m = 0; m < MR; m++) {
                    __m256i t;
                    __asm__("vpbroadcastd %[a], %[t]\n\t"
                            "vpsignb %[sgn], %[t], %[t]\n\t"
                            "vpmaddubsw %[t], %[u], %[t]\n\t"
                            "vpmaddwd %[ones], %[t], %[t]\n\t"
                            "vpaddd %[t], %[d], %[d]"
                            : [d] "+x"(dot[m]), [t] "=&x"(t)
                            : [a] "m"(*(const int32_t *)(ab + m * K + 4 * g)), [u] "x"(u), [sgn] "x"(sgn), [ones] "x"(ones));
                }
            }
            const uint16_t *dh = (const uint16_t *)blk + 16 * h + 8 * j;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh));
            for (int m = 0; m < MR; m++) {
                const __m256 s = _mm256_set1_ps(scale[m * nb + b]);
                __m256 c = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot[m]), _mm256_setzero_ps());
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
        if (FMT == I8_Q4_1) q4_1_rows_h(MR, a, scale, asum, K, w, bias, y, ldy, nvalid);                     \
        else q8_0_rows_q(MR, a, scale, asum, K, w, bias, y, ldy, nvalid); }
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
