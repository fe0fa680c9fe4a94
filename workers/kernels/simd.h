/* The vector operations the kernels use, for the two instruction sets they are built for.
 *
 *   AVX-512 (-mavx512f -mf16c -mfma ...): vf = __m512, VL = 16 float32 lanes.
 *   AVX2 + FMA + F16C (-mavx2 -mfma -mf16c):  vf = __m256, VL = 8 float32 lanes.
 *
 * Every kernel is written once against these names and compiled once per instruction set
 * (workers/kernels/build.py). Each lane does the same float32 operations in the same order on both
 * sets (one FMA per k, block sums added in order), so both builds return bit-identical results.
 */
#ifndef RD_SIMD_H
#define RD_SIMD_H

#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define RD_ISA "avx512"
#define VL 16
typedef __m512 vf;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vset1(s) _mm512_set1_ps(s)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
/* VL half-precision values at p (IEEE binary16, as GGUF stores block scales) -> float32. */
static inline vf v_from_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* The low (hi = 0) or high (hi = 1) 4 bits of VL bytes at p, as float32 0..15: a 16-entry table
 * lookup (vpermps reads only an index's low 4 bits, so the low nibble needs no mask), on port 5,
 * instead of a conversion on port 0, which the FMAs already keep busy. Exact either way. */
static inline vf v_from_nibbles(const uint8_t *p, int hi) {
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_permutexvar_ps(hi ? _mm512_srli_epi32(b, 4) : b, values);
}
/* VL signed bytes at p as float32 -128..127. */
static inline vf v_from_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RD_ISA "avx2"
#define VL 8
typedef __m256 vf;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define vset1(s) _mm256_set1_ps(s)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline vf v_from_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf v_from_nibbles(const uint8_t *p, int hi) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    b = hi ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(0xF));
    return _mm256_cvtepi32_ps(b);
}
static inline vf v_from_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

#else
#error "rdserve's kernels need AVX-512, or AVX2 with FMA and F16C; elsewhere torch's GEMM is used"
#endif

#endif
