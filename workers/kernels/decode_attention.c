/* Attention of a few new tokens per request over the paged KV cache (decoding, ReDrafter tree
 * verification), float32, grouped-query:
 *
 *   out[b, t, h] = sum_j p[t, j] v[j, h / G],   p[t, :] = softmax_j(scale * q[b, t, h] . k[j, h / G])
 *
 * over the keys j that mask[b, t, j] lets row t see (scaled dot-product attention, Vaswani et al.
 * 2017, arXiv 1706.03762 Sec. 3.2.1; G = n_heads / n_kv query heads share a key/value head,
 * Ainslie et al. 2023, arXiv 2305.13245). Keys and values are read in place from the cache
 * ``[slots, n_kv, D]`` through each request's slot list (or one contiguous run of slots), never
 * gathered; a masked key counts for nothing (it is read only when it shares a block of 8 keys with
 * a visible one, so every slot must lie in the cache: decode_attention.plan checks them).
 *
 * The cache holds float32, IEEE binary16 (a float16 KV cache, half the bytes a step reads) or int8
 * rows with one float32 scale per token and key/value head (a quarter plus 4 bytes a row: llama.cpp's
 * q8_0 KV cache quantizes the same way, per 32 values); halves and bytes are widened exactly before
 * the same float32 arithmetic. From int8 keys a score is dot(q, x) * (s * scale); a value row
 * enters its weighted sum as (p * s) x, while the softmax normalizer sums the weights p alone.
 *
 * Several rows of a request (a draft tree, a prompt chunk) mostly see the same keys: the context
 * before them. Each row's keys are found once per call (extent_t: the leading run every key of which
 * it sees, and its last visible key); with one query head per key/value head (G = 1), two or three
 * rows that all see a block of 8 keys take the keys' scores together (each key loaded, and widened from binary16, once for them), and blocks of
 * up to 6 rows (AVX-512; 4 on AVX2) weigh the values of the keys they all see together (each value
 * loaded once for the block, no mask checks); keys after a row's last visible key are not touched.
 * On the default model's heads (AMX Xeon) this made a 7-row tree's attention 1.4-1.7x and a 64-row
 * prompt chunk's 1.25x faster than row by row, in the same bits (benchmarks/decode_attention.py
 * --baseline).
 *
 * The G query heads of one key/value head (G > 1) are computed together (head_group): each key and
 * value is loaded and widened once for the G heads, not once per head, and the next keys and values
 * are prefetched (a token's key/value heads lie side by side in the cache, so one head's keys are
 * strided and the hardware prefetchers fell behind). On the AMX Xeon this made batch-16 plain steps'
 * attention 0.76x, a batch-1 plain step's at 1,024 tokens 0.70x and a 7-row tree's 0.83x the time
 * of the head-by-head kernel (float16 cache), in the same bits (benchmarks/decode_attention.py
 * --baseline). On AVX2 the G heads' scores share each key's loads and widening too (score_block_rows
 * key by key; before, only the values were shared there): on the EPYC AVX2 (Zen 3), float16 cache, a
 * 6-row tree at 400 tokens of context took 0.80-0.87x and batch-16 plain steps 0.93-0.95x the time,
 * in the same bits; from a float32 cache (no widening to share) it measured no faster, so there each
 * head still scores alone. Two rows of a tree that both see a block of keys score it together too
 * (2 G rows, score_block_ptrs): 0.94-0.96x again on 4- and 6-row trees (one run of five 1.05x).
 *
 * Rounding: each score is one 16-lane dot product (simd.h's v16, the same order on both builds);
 * exp is a fixed polynomial evaluated lane by lane; the weights and the weighted sum of values are
 * accumulated key by key in cache order over the row's visible keys only. So a row's result
 * depends only on its query and its visible keys, in order: not on the other rows, requests or
 * masked keys of the call (a 1-token step and a draft tree compute the same bits), and the AVX-512
 * and AVX2 builds agree bit for bit. Softmax subtracts the row's maximum first (numerically stable).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* Scratch per thread: scores of the rows an item computes, [rows][Lp] (Lp = L rounded up to 16): T rows of
 * one head (head), or a chunk's rows times G heads (head_group). */
typedef struct {
    const float *q;
    const char *kc, *vc; /* float32, binary16 or int8 elements of es bytes, rows of row_bytes (kind) */
    const int64_t *slots;
    const uint8_t *mask;
    float *out;
    long q_stride, out_stride, run_start, T, L, Lp, H, HKV, D, es, row_bytes;
    long call; /* this call's number (row_extents reuses a request's extents within one call only) */
    float scale;
} args_t;

#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* What the cache holds (kv_kind): float32, IEEE binary16, or int8 rows (D signed bytes, then the
 * row's float32 scale). */
enum { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2 };
/* Tuning (-D to override): PF_KEYS keys ahead prefetched (0: none; 16 = two blocks of 8), PF_VALUES
 * values ahead, GROUP_ROWS the most rows of a request one thread takes in a grouped item. Measured on
 * the AMX Xeon only (BENCHMARKS.md 14). */
#ifndef PF_KEYS
#define PF_KEYS 16
#endif
#ifndef GROUP_ROWS
#define GROUP_ROWS 16
#endif
#ifndef PF_VALUES
#define PF_VALUES 8
#endif

/* The address of element d0 of key/value head kvh of the j-th key's slot. */
ALWAYS_INLINE const char *row_of(const args_t *a, const char *cache, const int64_t *slots, long j, long kvh, long d0) {
    return cache + ((slots ? slots[j] : a->run_start + j) * a->HKV + kvh) * a->row_bytes + d0 * a->es;
}

/* Prefetch (into L1) the keys j .. j + 7 of key/value head kvh (nothing when j + 8 > L: the tail block
 * is not prefetched; a prefetch never faults, but the slot list must not be read past L): the
 * cache holds a token's key/value heads side by side, so one head's keys are strided and the
 * hardware prefetchers fall behind (batch 16 plain read 11 GB/s of a 27 GB/s machine without). */
ALWAYS_INLINE void prefetch_keys(const args_t *a, const int64_t *slots, long j, long kvh) {
    if (!PF_KEYS || j + 8 > a->L) return;
    for (long i = 0; i < 8; i++) {
        const char *k = row_of(a, a->kc, slots, j + i, kvh, 0);
        for (long off = 0; off < a->row_bytes; off += 64) _mm_prefetch(k + off, _MM_HINT_T0);
        if (a->row_bytes % 64) _mm_prefetch(k + a->row_bytes - 1, _MM_HINT_T0); /* int8 rows: the scale's line */
    }
}

/* acc + q[d .. d + 15] * key[d .. d + 15], the key in the cache's element type. */
ALWAYS_INLINE v16 fma_kv(const float *q, const char *key, long d, int kind, v16 acc) {
    return kind == KV_I8   ? v16_fma_i8(q + d, (const int8_t *)key + d, acc)
           : kind == KV_F16 ? v16_fma_h(q + d, (const uint16_t *)key + d, acc)
                            : v16_fma(q + d, (const float *)key + d, acc);
}

/* acc + p * v[16 c .. 16 c + 15], the value in the cache's element type (int8: p already times the
 * value row's scale, value_scale). */
ALWAYS_INLINE v16 axpy_kv(float p, const char *v, int c, int kind, v16 acc) {
    return kind == KV_I8 ? v16_axpy_v(p, v16_load_i8((const int8_t *)v + 16 * c), acc)
           : kind == KV_F16 ? v16_axpy_h(p, (const uint16_t *)v + 16 * c, acc)
                            : v16_axpy(p, (const float *)v + 16 * c, acc);
}

/* v[0 .. 15] widened: float32 as is, binary16 and int8 exactly (v16_axpy_v's operand). */
ALWAYS_INLINE v16 load_kv(const char *v, int kind) {
    return kind == KV_I8 ? v16_load_i8((const int8_t *)v) : kind == KV_F16 ? v16_load_h((const uint16_t *)v)
                                                                          : v16_load((const float *)v);
}

/* An int8 cache row's float32 scale (after its D values; row: the row's element d0). */
ALWAYS_INLINE float row_scale(const args_t *a, const char *row, long d0) {
    float s;
    memcpy(&s, row + (a->D - d0), sizeof s);
    return s;
}

/* The factor each of eight keys' dot products is multiplied by: the softmax scale, times the key's
 * own scale in an int8 cache (keys n .. 7 absent: 0). One rounding per score on every path. */
ALWAYS_INLINE __m256 key_factors(const args_t *a, const char *const keys[8], long n, int kind) {
    if (kind != KV_I8) return _mm256_set1_ps(a->scale);
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = i < n ? row_scale(a, keys[i], 0) : 0.0f;
    /* from registers, not a store and a reload (which stalls store forwarding) */
    return _mm256_mul_ps(_mm256_setr_ps(f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]), _mm256_set1_ps(a->scale));
}

/* Where one row's visible keys lie: mask[t][0 .. run - 1] are all visible (a tree's context, a
 * prompt chunk's context and earlier rows), and none at or after hi (0: no visible key). Keys in
 * [run, hi) are checked one by one. */
typedef struct {
    long run, hi;
} extent_t;

/* Scores of rows t of one head for keys j0 .. j0 + n - 1 (n <= 8): one 16-lane dot product per key,
 * eight keys' sums reduced together (v16_sum8, position-independent order). */
ALWAYS_INLINE void score_block(const args_t *a, const float *q, const char *keys[8], long n, float *s, int kind) {
    v16 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = v16_zero();
    if (n == 8)
        for (long d = 0; d < a->D; d += 16)
            for (int i = 0; i < 8; i++) acc[i] = fma_kv(q, keys[i], d, kind, acc[i]);
    else
        for (long d = 0; d < a->D; d += 16)
            for (int i = 0; i < n; i++) acc[i] = fma_kv(q, keys[i], d, kind, acc[i]);
    float sums[8];
    _mm256_storeu_ps(sums, _mm256_mul_ps(v16_sum8(acc), key_factors(a, keys, n, kind)));
    for (long i = 0; i < n; i++) s[i] = sums[i];
}

#if VL == 16
/* score_block for R rows (2 or 3) over eight keys they all see: each key's 16 elements loaded (and
 * widened) once for the R rows; every score computed exactly as score_block computes it. */
ALWAYS_INLINE void score_block_rows(const args_t *a, int R, const float *q, long q_stride, const char *keys[8],
                                    float *s, long s_stride, int kind) {
    __m512 acc[3][8];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 8; i++) acc[r][i] = _mm512_setzero_ps();
    for (long d = 0; d < a->D; d += 16) {
        __m512 x[3];
        for (int r = 0; r < R; r++) x[r] = _mm512_loadu_ps(q + r * q_stride + d);
        for (int i = 0; i < 8; i++) {
            __m512 k = kind == KV_I8    ? v_from_i8((const int8_t *)keys[i] + d)
                       : kind == KV_F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)keys[i] + d)))
                                        : _mm512_loadu_ps((const float *)keys[i] + d);
            for (int r = 0; r < R; r++) acc[r][i] = _mm512_fmadd_ps(x[r], k, acc[r][i]);
        }
    }
    __m256 sc = key_factors(a, keys, 8, kind);
    for (int r = 0; r < R; r++) {
        v16 v[8];
        for (int i = 0; i < 8; i++) v[i].v = acc[r][i];
        _mm256_storeu_ps(s + r * s_stride, _mm256_mul_ps(v16_sum8(v), sc));
    }
}
#else
/* R query rows' scores for eight keys they all see, on AVX2 (a v16 is two ymm registers, so R rows'
 * accumulators for eight keys do not fit): key by key (two at a time for R <= 3), its D elements
 * loaded and widened once for the R rows, each row's two 8-lane FMA chains (v16_fma's, in d order)
 * folded as v16_fold folds them, then the eight keys' folds reduced by v16_sum8's operations
 * (v16_sum8_folded): every score the bits of score_block's. Row r: queries qs[r], scores ss[r][0..7]. */
#define SHARE_MAX 6
ALWAYS_INLINE void score_block_ptrs(const args_t *a, int R, const float *const *qs, const char *keys[8],
                                    float *const *ss, int kind) {
    __m256 f[SHARE_MAX][8];
    const int KI = R <= 3 ? 2 : 1; /* keys per pass: their 4 R accumulators stay in registers */
    for (int i = 0; i < 8; i += KI) {
        __m256 lo[2][SHARE_MAX], hi[2][SHARE_MAX];
        for (int k = 0; k < KI; k++)
            for (int r = 0; r < R; r++) lo[k][r] = hi[k][r] = _mm256_setzero_ps();
        for (long d = 0; d < a->D; d += 16) {
            for (int k = 0; k < KI; k++) {
                __m256 kl, kh;
                if (kind == KV_I8) {
                    const int8_t *kp = (const int8_t *)keys[i + k] + d;
                    kl = v_from_i8(kp);
                    kh = v_from_i8(kp + 8);
                } else if (kind == KV_F16) {
                    const uint16_t *kp = (const uint16_t *)keys[i + k] + d;
                    kl = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)kp));
                    kh = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kp + 8)));
                } else {
                    kl = _mm256_loadu_ps((const float *)keys[i + k] + d);
                    kh = _mm256_loadu_ps((const float *)keys[i + k] + d + 8);
                }
                for (int r = 0; r < R; r++) {
                    lo[k][r] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[r] + d), kl, lo[k][r]);
                    hi[k][r] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[r] + d + 8), kh, hi[k][r]);
                }
            }
        }
        for (int k = 0; k < KI; k++)
            for (int r = 0; r < R; r++) f[r][i + k] = _mm256_add_ps(lo[k][r], hi[k][r]);
    }
    __m256 sc = key_factors(a, keys, 8, kind);
    for (int r = 0; r < R; r++) _mm256_storeu_ps(ss[r], _mm256_mul_ps(v16_sum8_folded(f[r]), sc));
}

/* score_block_rows (AVX-512's signature): rows q + r q_stride, scores s + r s_stride. */
ALWAYS_INLINE void score_block_rows(const args_t *a, int R, const float *q, long q_stride, const char *keys[8],
                                    float *s, long s_stride, int kind) {
    const float *qs[SHARE_MAX];
    float *ss[SHARE_MAX];
    for (int r = 0; r < R; r++) qs[r] = q + r * q_stride, ss[r] = s + r * s_stride;
    score_block_ptrs(a, R, qs, keys, ss, kind);
}
#endif

/* One row's scores for the n keys of a block: computed where the row sees a key of it (one call of
 * score_block: a second call site for keys it all sees measured 10% slower at batch 16), masked keys
 * set to -inf. */
ALWAYS_INLINE void score_row(const args_t *a, const float *q, const char *keys[8], long n, const uint8_t *m, float *st,
                             int kind) {
    int any = 0;
    for (long i = 0; i < n; i++) any |= m[i];
    if (any) score_block(a, q, keys, n, st, kind);
    for (long i = 0; i < n; i++)
        if (!m[i]) st[i] = -INFINITY;
}

/* Row blocks of the weighted sums: up to 6 rows keep their 6 x 4 accumulators in zmm registers
 * on AVX-512; on AVX2 blocks of 4 rows (some accumulators spill) ran faster than 1 or 2. */
#if VL == 16
#define RB_MAX 6
#else
#define RB_MAX 4
#endif
/* The rows a block of weighted sums serves (up to RB_MAX): each row's mask row [L], scores [Lp] and
 * output (16 NC floats from d0). */
typedef struct {
    const uint8_t *m[RB_MAX];
    const float *s[RB_MAX];
    float *o[RB_MAX];
} rowset_t;

/* out rows of RB query rows for head dims d0 .. d0 + 16 NC: weights times values, and the
 * weights themselves, summed key by key over each row's visible keys in cache order, in registers.
 * Keys before run (every row of the block sees them) go without mask checks, each value loaded once
 * for all RB rows; keys from run to hi row by row. */
ALWAYS_INLINE void weigh_values(const args_t *a, const rowset_t *rs, const int64_t *slots, long kvh, int RB, int NC,
                                long d0, long run, long hi, int kind) {
    v16 acc[RB_MAX][4];
    float sum[RB_MAX];
    for (int r = 0; r < RB; r++) {
        sum[r] = 0.0f;
        for (int c = 0; c < NC; c++) acc[r][c] = v16_zero();
    }
    for (long j = 0; j < run; j++) {
        const char *v = row_of(a, a->vc, slots, j, kvh, d0);
        if (PF_VALUES && j + PF_VALUES < run) {
            const char *pv = row_of(a, a->vc, slots, j + PF_VALUES, kvh, d0);
            for (long off = 0; off < 16 * NC * a->es; off += 64) _mm_prefetch(pv + off, _MM_HINT_T0);
            if (kind == KV_I8) _mm_prefetch(pv + (a->D - d0) + 3, _MM_HINT_T0); /* the row's scale */
        }
        v16 x[4];
        for (int c = 0; c < NC; c++) x[c] = load_kv(v + 16 * c * a->es, kind);
        const float sv = kind == KV_I8 ? row_scale(a, v, d0) : 1.0f;
        for (int r = 0; r < RB; r++) {
            float p = rs->s[r][j];
            sum[r] += p;
            if (kind == KV_I8) p *= sv; /* the weight times the value row's scale: one rounding */
            for (int c = 0; c < NC; c++) acc[r][c] = v16_axpy_v(p, x[c], acc[r][c]);
        }
    }
    for (long j = run; j < hi; j++) {
        const char *v = 0;
        for (int r = 0; r < RB; r++) {
            if (!rs->m[r][j]) continue;
            if (!v) v = row_of(a, a->vc, slots, j, kvh, d0);
            float p = rs->s[r][j];
            sum[r] += p;
            if (kind == KV_I8) p *= row_scale(a, v, d0);
            for (int c = 0; c < NC; c++) acc[r][c] = axpy_kv(p, v, c, kind, acc[r][c]);
        }
    }
    for (int r = 0; r < RB; r++) {
        float inv = sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f; /* no visible key: zeros */
        for (int c = 0; c < NC; c++) v16_store_scaled(rs->o[r] + d0 + 16 * c, acc[r][c], inv);
    }
}

ALWAYS_INLINE void weigh_rows(const args_t *a, const rowset_t *rs, const int64_t *slots, long kvh, int RB, long run,
                              long hi, int kind) {
    for (long d0 = 0; d0 < a->D; d0 += 64) {
        int NC = a->D - d0 >= 64 ? 4 : (int)((a->D - d0) / 16);
        /* constant RB and NC in the common cases, so the accumulators stay in registers */
#define WEIGH(R, C) weigh_values(a, rs, slots, kvh, R, C, d0, run, hi, kind)
        if (NC == 4) {
            switch (RB) {
            case 1: WEIGH(1, 4); break;
            case 2: WEIGH(2, 4); break;
            case 3: WEIGH(3, 4); break;
            case 4: WEIGH(4, 4); break;
#if RB_MAX >= 6
            case 5: WEIGH(5, 4); break;
            case 6: WEIGH(6, 4); break;
#endif
            default: WEIGH(RB, 4);
            }
        } else
            WEIGH(RB, NC);
#undef WEIGH
    }
}

/* The scores of T > 1 rows (a draft tree, a prompt chunk): rows that all see an 8-key block take it
 * together (score_block_rows), others row by row; blocks past a row's last visible key are skipped
 * (never read). Kept out of head: inlined there, it slowed the one-row loop of batch-16 plain steps
 * by ~10%. */
static __attribute__((noinline)) void score_rows(const args_t *a, const uint8_t *mask, const int64_t *slots,
                                                 const float *q, const extent_t *ext, long kvh, float *s, int kind) {
    const long T = a->T, L = a->L, Lp = a->Lp;
    long hi_all = 0;
    for (long t = 0; t < T; t++) hi_all = ext[t].hi > hi_all ? ext[t].hi : hi_all;
    for (long j0 = 0; j0 < hi_all; j0 += 8) {
        long n = L - j0 < 8 ? L - j0 : 8;
        const char *keys[8];
        for (long i = 0; i < n; i++) keys[i] = row_of(a, a->kc, slots, j0 + i, kvh, 0);
        prefetch_keys(a, slots, j0 + PF_KEYS, kvh);
        for (long t = 0; t < T; t++) {
            if (j0 >= ext[t].hi) continue; /* past the row's last visible key: never read */
#if VL == 16
            /* the next 3 or 2 rows all see the block: its keys read once for them */
            int R = 1;
            while (R < 3 && n == 8 && t + R < T && j0 + 8 <= ext[t + R].run) R++;
            if (R > 1 && j0 + 8 <= ext[t].run) {
                if (R == 3) score_block_rows(a, 3, q + t * a->q_stride, a->q_stride, keys, s + t * Lp + j0, Lp, kind);
                else score_block_rows(a, 2, q + t * a->q_stride, a->q_stride, keys, s + t * Lp + j0, Lp, kind);
                t += R - 1;
                continue;
            }
#endif
            score_row(a, q + t * a->q_stride, keys, n, mask + t * L + j0, s + t * Lp + j0, kind);
        }
    }
}

/* The extents of rows of mask [T, L] (row_extents). */
static void extents(const uint8_t *mask, long T, long L, extent_t *e) {
    for (long t = 0; t < T; t++) {
        const uint8_t *m = mask + t * L, *zero = memchr(m, 0, (size_t)L);
        long run = zero ? zero - m : L, hi = L;
        uint64_t w;
        while (hi - 8 >= run && (memcpy(&w, m + hi - 8, 8), w == 0)) hi -= 8;
        while (hi > run && !m[hi - 1]) hi--;
        e[t].run = run, e[t].hi = hi;
    }
}

/* The extents of the T rows of mask [T, L], computed once per call and request by each thread (the
 * heads of a request share them). NULL: no memory. */
static const extent_t *row_extents(const args_t *a, const uint8_t *mask) {
    static _Thread_local long last_call = -1, cap;
    static _Thread_local const uint8_t *last_mask;
    static _Thread_local extent_t *e;
    if (a->T > cap) {
        free(e);
        e = malloc(sizeof(extent_t) * (size_t)a->T);
        cap = e ? a->T : 0;
        last_call = -1;
    }
    if (!e) return 0;
    if (last_call != a->call || last_mask != mask) extents(mask, a->T, a->L, e);
    last_call = a->call, last_mask = mask;
    return e;
}

/* A row's scores st[0 .. hi) -> exp(score - the row's maximum), in place, up to hi rounded up to the
 * vector width: masked ones are -inf (weight 0), later ones never read. */
ALWAYS_INLINE void exp_scores(float *st, long hi) {
    long hp = (hi + VL - 1) / VL * VL;
    float lanes[VL], m = -INFINITY;
    for (long j = hi; j < hp; j++) st[j] = -INFINITY;
    vf vm = vset1(-INFINITY); /* masked scores are -inf already; the maximum is exact in any order */
    for (long j = 0; j < hp; j += VL) vm = vmax(vm, vload(st + j));
    vstore(lanes, vm);
    for (int i = 0; i < VL; i++) m = lanes[i] > m ? lanes[i] : m;
    vm = vset1(m == -INFINITY ? 0.0f : m); /* a row without visible keys: all weights unused */
    for (long j = 0; j < hp; j += VL) vstore(st + j, vexp_nonpositive(vsub(vload(st + j), vm)));
}

/* All T rows of request b, query head h. Returns -1 without memory for the rows' extents. */
ALWAYS_INLINE int head(const args_t *a, long b, long h, float *s, int kind) {
    const long T = a->T, L = a->L, Lp = a->Lp, kvh = h / (a->H / a->HKV);
    const uint8_t *mask = a->mask + b * T * L;
    const int64_t *slots = a->slots ? a->slots + b * L : 0;
    const float *q = a->q + b * T * a->q_stride + h * a->D;
    extent_t one; /* a single row: no per-thread buffer */
    const extent_t *ext = T == 1 ? (extents(mask, 1, L, &one), &one) : row_extents(a, mask);
    if (!ext) return -1;
    if (T == 1) /* a plain step; this loop's form measured ~10% faster at batch 16 than variants */
        for (long j0 = 0; j0 < L; j0 += 8) {
            long n = L - j0 < 8 ? L - j0 : 8;
            const char *keys[8];
            for (long i = 0; i < n; i++) keys[i] = row_of(a, a->kc, slots, j0 + i, kvh, 0);
            prefetch_keys(a, slots, j0 + PF_KEYS, kvh);
            score_row(a, q, keys, n, mask + j0, s + j0, kind);
        }
    else
        score_rows(a, mask, slots, q, ext, kvh, s, kind);
    for (long t = 0; t < T; t++) exp_scores(s + t * Lp, ext[t].hi);
    long out_stride = a->out_stride;
    float *out0 = a->out + b * T * out_stride + h * a->D;
    /* rows in blocks of at most RB_MAX, as even as possible (7 rows: 4 + 3, not 6 + 1) */
    long blocks = (T + RB_MAX - 1) / RB_MAX;
    for (long k = 0, t0 = 0; k < blocks; k++) {
        int RB = (int)((T - t0) / (blocks - k));
        long run = L, hi = 0;
        for (long t = t0; t < t0 + RB; t++) {
            run = ext[t].run < run ? ext[t].run : run;
            hi = ext[t].hi > hi ? ext[t].hi : hi;
        }
        rowset_t rs;
        for (int r = 0; r < RB; r++)
            rs.m[r] = mask + (t0 + r) * L, rs.s[r] = s + (t0 + r) * Lp, rs.o[r] = out0 + (t0 + r) * out_stride;
        weigh_rows(a, &rs, slots, kvh, RB, run, hi, kind);
        t0 += RB;
    }
    return 0;
}

/* Rows t_lo .. t_hi - 1 of request b for the G > 1 query heads that share key/value head kvh
 * (grouped-query attention: the cache holds one key/value head per G query heads), taken as
 * (t_hi - t_lo) G rows, row (t, g) seeing what mask row t lets it see: each key and value is loaded,
 * and widened from binary16, once for the G heads (and the values once for up to RB_MAX rows)
 * instead of once per head. Every score and weighted sum is computed as head() computes it for each
 * head alone (score_block / score_block_rows, weigh_values with each row's own accumulators), so the
 * bits are the same. s: scratch of (t_hi - t_lo) G rows of Lp floats. Returns -1 without memory for
 * the rows' extents. */
ALWAYS_INLINE int head_group(const args_t *a, long b, long kvh, long t_lo, long t_hi, float *s, int kind) {
    const long T = a->T, L = a->L, Lp = a->Lp, D = a->D, G = a->H / a->HKV;
    const uint8_t *mask = a->mask + b * T * L;
    const int64_t *slots = a->slots ? a->slots + b * L : 0;
    const float *q = a->q + b * T * a->q_stride + kvh * G * D;
    extent_t one;
    const extent_t *ext = T == 1 ? (extents(mask, 1, L, &one), &one) : row_extents(a, mask);
    if (!ext) return -1;
    long hi_all = 0;
    for (long t = t_lo; t < t_hi; t++) hi_all = ext[t].hi > hi_all ? ext[t].hi : hi_all;
    for (long j0 = 0; j0 < hi_all; j0 += 8) {
        long n = L - j0 < 8 ? L - j0 : 8;
        const char *keys[8];
        for (long i = 0; i < n; i++) keys[i] = row_of(a, a->kc, slots, j0 + i, kvh, 0);
        prefetch_keys(a, slots, j0 + PF_KEYS, kvh);
        for (long t = t_lo; t < t_hi; t++) {
            if (j0 >= ext[t].hi) continue; /* past the row's last visible key: never read */
            const uint8_t *m = mask + t * L + j0;
            const float *qt = q + t * a->q_stride;
            float *st = s + (t - t_lo) * G * Lp + j0;
            int full = j0 + 8 <= ext[t].run, any = full;
            for (long i = 0; i < n && !any; i++) any |= m[i];
#if VL == 8
            /* AVX2, binary16 cache: this row's G heads and the next row's, when both see all eight
             * keys, from one widening of each key */
            if (kind != KV_F32 && n == 8 && full && 2 * G <= SHARE_MAX && t + 1 < t_hi && j0 + 8 <= ext[t + 1].run) {
                const float *qs[SHARE_MAX] = {0};
                float *ss[SHARE_MAX] = {0};
                for (long g = 0; g < 2 * G; g++)
                    qs[g] = qt + (g / G) * a->q_stride + (g % G) * D, ss[g] = st + (g / G) * G * Lp + (g % G) * Lp;
                if (G == 3) score_block_ptrs(a, 6, qs, keys, ss, kind);
                else score_block_ptrs(a, (int)(2 * G), qs, keys, ss, kind);
                t++;
                continue;
            }
#endif
            /* the G heads' scores of these keys together, masked ones -inf after (on AVX2 only from a
             * binary16 cache: float32 keys need no widening, and sharing their loads measured no faster) */
            if (n == 8 && any && (VL == 16 || kind != KV_F32)) {
                for (long g = 0; g < G;) {
                    long R = G - g >= 3 ? 3 : G - g;
                    if (R == 3) score_block_rows(a, 3, qt + g * D, D, keys, st + g * Lp, Lp, kind);
                    else if (R == 2) score_block_rows(a, 2, qt + g * D, D, keys, st + g * Lp, Lp, kind);
                    else score_block(a, qt + g * D, keys, 8, st + g * Lp, kind);
                    g += R;
                }
                if (!full)
                    for (long g = 0; g < G; g++)
                        for (long i = 0; i < 8; i++)
                            if (!m[i]) st[g * Lp + i] = -INFINITY;
                continue;
            }
            for (long g = 0; g < G; g++) score_row(a, qt + g * D, keys, n, m, st + g * Lp, kind);
        }
    }
    const long rows = (t_hi - t_lo) * G;
    for (long c = 0; c < rows; c++) exp_scores(s + c * Lp, ext[t_lo + c / G].hi);
    /* rows (t, g) in blocks of at most RB_MAX, as even as possible */
    long blocks = (rows + RB_MAX - 1) / RB_MAX;
    float *out0 = a->out + b * T * a->out_stride + kvh * G * D;
    for (long k = 0, c0 = 0; k < blocks; k++) {
        int RB = (int)((rows - c0) / (blocks - k));
        long run = L, hi = 0;
        rowset_t rs;
        for (int r = 0; r < RB; r++) {
            long c = c0 + r, t = t_lo + c / G, g = c % G;
            run = ext[t].run < run ? ext[t].run : run;
            hi = ext[t].hi > hi ? ext[t].hi : hi;
            rs.m[r] = mask + t * L, rs.s[r] = s + c * Lp, rs.o[r] = out0 + t * a->out_stride + g * D;
        }
        weigh_rows(a, &rs, slots, kvh, RB, run, hi, kind);
        c0 += RB;
    }
    return 0;
}

/* The three instantiations: float32, binary16 and int8 caches. */
static int group_f32(const args_t *a, long b, long kvh, long t_lo, long t_hi, float *s) {
    return head_group(a, b, kvh, t_lo, t_hi, s, KV_F32);
}
static int group_f16(const args_t *a, long b, long kvh, long t_lo, long t_hi, float *s) {
    return head_group(a, b, kvh, t_lo, t_hi, s, KV_F16);
}
static int group_i8(const args_t *a, long b, long kvh, long t_lo, long t_hi, float *s) {
    return head_group(a, b, kvh, t_lo, t_hi, s, KV_I8);
}
static int head_f32(const args_t *a, long b, long h, float *s) { return head(a, b, h, s, KV_F32); }
static int head_f16(const args_t *a, long b, long h, float *s) { return head(a, b, h, s, KV_F16); }
static int head_i8(const args_t *a, long b, long h, float *s) { return head(a, b, h, s, KV_I8); }

/* q: row (b * T + t) at q + (b * T + t) * q_stride, heads of D floats side by side;
 * kc, vc: the cache [slots, n_kv, D], float32 (kv_kind 0) or binary16 (1), or [slots, n_kv, D + 4] bytes
 * (2: each row D int8 values x, then its float32 scale s; the value is s x); slots: [B, L] int64
 * or NULL (then request b = 0 reads slots run_start .. run_start + L - 1); mask: [B, T, L] bool
 * bytes; out: [B * T, H * D].
 * H must be a multiple of HKV and D a multiple of 16. Returns 0, or -1 when scratch memory could
 * not be allocated (out is then incomplete). Threads split the (request, key/value head) pairs, a
 * request's rows in chunks of at most GROUP_ROWS, and in more chunks where pairs are fewer than 2 per
 * thread (G > 1), or the (request, query head) pairs (G = 1, and single rows with fewer pairs than
 * threads: a pair's G heads on one thread would then be the step's critical path). B or T of 0: nothing
 * to do, returns 0. */
int rd_decode_attention(const float *q, long q_stride, const void *kc, const void *vc, const int64_t *slots,
                        long run_start, const uint8_t *mask, float *out, long B, long T, long L, long H, long HKV,
                        long D, float scale, long kv_kind) {
    static long calls;
    const long es = kv_kind == KV_I8 ? 1 : kv_kind == KV_F16 ? 2 : 4;
    args_t a = {q, kc, vc, slots, mask, out, q_stride, H * D, run_start, T, L, (L + 15) / 16 * 16, H, HKV, D,
                es, kv_kind == KV_I8 ? D + 4 : D * es, 0, scale};
    long call;
#pragma omp atomic capture
    call = ++calls;
    a.call = call;
    int (*one_head)(const args_t *, long, long, float *) =
        kv_kind == KV_I8 ? head_i8 : kv_kind == KV_F16 ? head_f16 : head_f32;
    int failed = 0;
    long G = H / HKV;
    /* G > 1: the (request, key/value head) pairs, a request's rows split into chunks of at most
     * GROUP_ROWS rows, and into more chunks where there are fewer pairs than 2 per thread. */
    if (B * T == 0) return 0;
    int nthreads = omp_get_max_threads();
    int grouped = G > 1 && (T > 1 || B * HKV >= nthreads);
    long pairs = B * HKV, chunks = 1;
    if (grouped) {
        long want = (2 * nthreads + pairs - 1) / pairs;
        chunks = (T + GROUP_ROWS - 1) / GROUP_ROWS;
        chunks = want > chunks ? want : chunks;
        chunks = chunks < T ? chunks : T;
    }
    long chunk_rows = (T + chunks - 1) / chunks, rows = grouped ? chunk_rows * G : T;
    int (*one_group)(const args_t *, long, long, long, long, float *) =
        kv_kind == KV_I8 ? group_i8 : kv_kind == KV_F16 ? group_f16 : group_f32;
#pragma omp parallel if (B * H > 1)
    {
        float *s = malloc(sizeof(float) * (size_t)(rows * a.Lp));
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
        if (grouped) {
#pragma omp for schedule(static)
            for (long i = 0; i < pairs * chunks; i++) {
                long b = i / (HKV * chunks), kvh = i / chunks % HKV, c = i % chunks;
                /* chunk c: rows T c / chunks .. T (c + 1) / chunks - 1 (as even as possible) */
                long t_lo = T * c / chunks, t_hi = T * (c + 1) / chunks;
                if (s && t_lo < t_hi && one_group(&a, b, kvh, t_lo, t_hi, s)) {
#pragma omp atomic write
                    failed = 1;
                }
            }
        } else {
#pragma omp for collapse(2) schedule(static)
            for (long b = 0; b < B; b++)
                for (long h = 0; h < H; h++)
                    if (s && one_head(&a, b, h, s)) {
#pragma omp atomic write
                        failed = 1;
                    }
        }
        free(s);
    }
    return failed ? -1 : 0;
}
