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
#define vsub(a, b) _mm512_sub_ps(a, b)
#define vmax(a, b) _mm512_max_ps(a, b)
#define vround(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* 2^n for integral n in [-126, 127] (float32 exponent bits). */
static inline vf vpow2i(vf n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
/* A 16-lane float32 accumulator (one zmm here, two ymm on AVX2) and its sum folded to 8 lanes
 * (lane i + lane i + 8), so that reductions over 16 lanes round the same on both sets. */
typedef struct { __m512 v; } v16;
static inline v16 v16_zero(void) { v16 a = {_mm512_setzero_ps()}; return a; }
static inline v16 v16_fma(const float *a, const float *b, v16 c) {
    c.v = _mm512_fmadd_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b), c.v);
    return c;
}
static inline __m256 v16_fold(v16 a) { return _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1)); }
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
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vmax(a, b) _mm256_max_ps(a, b)
#define vround(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static inline vf vpow2i(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
typedef struct { __m256 lo, hi; } v16;
static inline v16 v16_zero(void) { v16 a = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return a; }
static inline v16 v16_fma(const float *a, const float *b, v16 c) {
    c.lo = _mm256_fmadd_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b), c.lo);
    c.hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8), _mm256_loadu_ps(b + 8), c.hi);
    return c;
}
static inline __m256 v16_fold(v16 a) { return _mm256_add_ps(a.lo, a.hi); }
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

/* acc + p * v[0..15], lane by lane (one rounding each). */
static inline v16 v16_axpy(float p, const float *v, v16 acc) {
    v16 pv;
#if VL == 16
    pv.v = _mm512_set1_ps(p);
    acc.v = _mm512_fmadd_ps(pv.v, _mm512_loadu_ps(v), acc.v);
#else
    pv.lo = _mm256_set1_ps(p);
    acc.lo = _mm256_fmadd_ps(pv.lo, _mm256_loadu_ps(v), acc.lo);
    acc.hi = _mm256_fmadd_ps(pv.lo, _mm256_loadu_ps(v + 8), acc.hi);
#endif
    return acc;
}

/* acc + a[0..15] * b[0..15] with b in IEEE binary16 (a KV cache in float16): the halves widen
 * exactly, so the products and sums round as v16_fma's do on the widened values, on both sets. */
static inline v16 v16_fma_h(const float *a, const uint16_t *b, v16 c) {
#if VL == 16
    c.v = _mm512_fmadd_ps(_mm512_loadu_ps(a), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b)), c.v);
#else
    c.lo = _mm256_fmadd_ps(_mm256_loadu_ps(a), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b)), c.lo);
    c.hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 8))), c.hi);
#endif
    return c;
}

/* v[0..15] as a v16: float32, or binary16 widened exactly (the values v16_axpy / v16_axpy_h read). */
static inline v16 v16_load(const float *v) {
    v16 a;
#if VL == 16
    a.v = _mm512_loadu_ps(v);
#else
    a.lo = _mm256_loadu_ps(v);
    a.hi = _mm256_loadu_ps(v + 8);
#endif
    return a;
}
static inline v16 v16_load_h(const uint16_t *v) {
    v16 a;
#if VL == 16
    a.v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)v));
#else
    a.lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)v));
    a.hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + 8)));
#endif
    return a;
}
/* acc + p * v, v already loaded: the bits of v16_axpy / v16_axpy_h on the same values. */
static inline v16 v16_axpy_v(float p, v16 v, v16 acc) {
#if VL == 16
    acc.v = _mm512_fmadd_ps(_mm512_set1_ps(p), v.v, acc.v);
#else
    __m256 pv = _mm256_set1_ps(p);
    acc.lo = _mm256_fmadd_ps(pv, v.lo, acc.lo);
    acc.hi = _mm256_fmadd_ps(pv, v.hi, acc.hi);
#endif
    return acc;
}
/* acc + p * v[0..15] with v in binary16 (v16_axpy on the widened values). */
static inline v16 v16_axpy_h(float p, const uint16_t *v, v16 acc) {
#if VL == 16
    acc.v = _mm512_fmadd_ps(_mm512_set1_ps(p), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)v)), acc.v);
#else
    __m256 pv = _mm256_set1_ps(p);
    acc.lo = _mm256_fmadd_ps(pv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)v)), acc.lo);
    acc.hi = _mm256_fmadd_ps(pv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + 8))), acc.hi);
#endif
    return acc;
}

/* int8 versions (a KV cache in int8 rows): the bytes widen exactly, then as v16_fma / v16_load. */
static inline v16 v16_fma_i8(const float *a, const int8_t *b, v16 c) {
#if VL == 16
    c.v = _mm512_fmadd_ps(_mm512_loadu_ps(a), v_from_i8(b), c.v);
#else
    c.lo = _mm256_fmadd_ps(_mm256_loadu_ps(a), v_from_i8(b), c.lo);
    c.hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8), v_from_i8(b + 8), c.hi);
#endif
    return c;
}
static inline v16 v16_load_i8(const int8_t *v) {
    v16 a;
#if VL == 16
    a.v = v_from_i8(v);
#else
    a.lo = v_from_i8(v);
    a.hi = v_from_i8(v + 8);
#endif
    return a;
}

/* out[0..15] = acc * s. */
static inline void v16_store_scaled(float *out, v16 acc, float s) {
#if VL == 16
    _mm512_storeu_ps(out, _mm512_mul_ps(acc.v, _mm512_set1_ps(s)));
#else
    _mm256_storeu_ps(out, _mm256_mul_ps(acc.lo, _mm256_set1_ps(s)));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(acc.hi, _mm256_set1_ps(s)));
#endif
}

/* The lane sums of eight v16 (lane i of the result: the sum of a[i]), each in the same order
 * whatever its position: fold 16 -> 8, then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). */
static inline __m256 v16_sum8_folded(const __m256 f[8]) { /* the same, of f[i] = v16_fold(a[i]) */
    __m256 h01 = _mm256_hadd_ps(f[0], f[1]), h23 = _mm256_hadd_ps(f[2], f[3]);
    __m256 h45 = _mm256_hadd_ps(f[4], f[5]), h67 = _mm256_hadd_ps(f[6], f[7]);
    __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}
static inline __m256 v16_sum8(const v16 a[8]) {
    __m256 f[8];
    for (int i = 0; i < 8; i++) f[i] = v16_fold(a[i]);
    return v16_sum8_folded(f);
}

/* The sum of a v16's lanes, in the same order on both sets: 16 -> 8 (v16_fold) -> 4 -> 2 -> 1. */
static inline float v16_sum(v16 a) {
    __m256 s8 = v16_fold(a);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

#if VL == 16
#define vdiv(a, b) _mm512_div_ps(a, b)
/* -|x|, lane by lane. */
static inline vf vneg_abs(vf x) { return _mm512_or_ps(x, _mm512_set1_ps(-0.0f)); }
/* a where x >= 0, else b (NaN lanes: b). */
static inline vf vselect_nonneg(vf x, vf a, vf b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), b, a);
}
#else
#define vdiv(a, b) _mm256_div_ps(a, b)
static inline vf vneg_abs(vf x) { return _mm256_or_ps(x, _mm256_set1_ps(-0.0f)); }
static inline vf vselect_nonneg(vf x, vf a, vf b) {
    return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}
#endif

/* exp(x) for x <= 0, lane by lane: x = n ln2 + r (|r| <= ln2 / 2, ln2 split in a short high part
 * and a correction, as in Cody & Waite 1980), exp(r) by its degree-7 Taylor polynomial (relative
 * error below 1e-8 on that range) times 2^n. x below -87 is taken as -87 (exp(-87) = 1.6e-38, far
 * below what a softmax weight next to the maximum's 1 can carry). */
static inline vf vexp_nonpositive(vf x) {
    x = vmax(x, vset1(-87.0f));
    vf n = vround(vmul(x, vset1(1.44269504088896341f)));
    vf r = vfma(n, vset1(-0.693359375f), x);
    r = vfma(n, vset1(2.12194440e-4f), r);
    vf p = vset1(1.0f / 5040);
    p = vfma(p, r, vset1(1.0f / 720));
    p = vfma(p, r, vset1(1.0f / 120));
    p = vfma(p, r, vset1(1.0f / 24));
    p = vfma(p, r, vset1(1.0f / 6));
    p = vfma(p, r, vset1(0.5f));
    p = vfma(p, r, vset1(1.0f));
    p = vfma(p, r, vset1(1.0f));
    return vmul(p, vpow2i(n));
}

#endif
