/* Attention of a few new tokens per request over the paged KV cache (decoding, ReDrafter tree
 * verification), float32, grouped-query:
 *
 *   out[b, t, h] = sum_j p[t, j] v[j, h / G],   p[t, :] = softmax_j(scale * q[b, t, h] . k[j, h / G])
 *
 * over the keys j that mask[b, t, j] lets row t see (scaled dot-product attention, Vaswani et al.
 * 2017, arXiv 1706.03762 Sec. 3.2.1; G = n_heads / n_kv query heads share a key/value head,
 * Ainslie et al. 2023, arXiv 2305.13245). Keys and values are read in place from the cache
 * ``[slots, n_kv, D]`` through each request's slot list (or one contiguous run of slots), never
 * gathered; masked keys are skipped, not read.
 *
 * The cache holds float32 or IEEE binary16 (``kv_half``: a float16 KV cache, half the bytes a
 * step reads); halves are widened exactly before the same float32 arithmetic.
 *
 * Rounding: each score is one 16-lane dot product (simd.h's v16, the same order on both builds);
 * exp is a fixed polynomial evaluated lane by lane; the weights and the weighted sum of values are
 * accumulated key by key in cache order over the row's visible keys only. So a row's result
 * depends only on its query and its visible keys, in order: not on the other rows, requests or
 * masked keys of the call (a 1-token step and a draft tree compute the same bits), and the AVX-512
 * and AVX2 builds agree bit for bit. Softmax subtracts the row's maximum first (numerically stable).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

/* Scratch per thread: scores [T][Lp] (Lp = L rounded up to 16). */
typedef struct {
    const float *q;
    const char *kc, *vc; /* float32 or binary16 elements of es bytes */
    const int64_t *slots;
    const uint8_t *mask;
    float *out;
    long q_stride, out_stride, run_start, T, L, Lp, H, HKV, D, es;
    long call; /* this call's number (head_f16_rows reuses a widened head within one call only) */
    float scale;
} args_t;

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The address of element d0 of key/value head kvh of the j-th key's slot. */
ALWAYS_INLINE const char *row_of(const args_t *a, const char *cache, const int64_t *slots, long j, long kvh, long d0) {
    return cache + (((slots ? slots[j] : a->run_start + j) * a->HKV + kvh) * a->D + d0) * a->es;
}

/* acc + q[d .. d + 15] * key[d .. d + 15], the key in the cache's element type. */
ALWAYS_INLINE v16 fma_kv(const float *q, const char *key, long d, int half, v16 acc) {
    return half ? v16_fma_h(q + d, (const uint16_t *)key + d, acc) : v16_fma(q + d, (const float *)key + d, acc);
}

/* acc + p * v[16 c .. 16 c + 15], the value in the cache's element type. */
ALWAYS_INLINE v16 axpy_kv(float p, const char *v, int c, int half, v16 acc) {
    return half ? v16_axpy_h(p, (const uint16_t *)v + 16 * c, acc) : v16_axpy(p, (const float *)v + 16 * c, acc);
}

/* Scores of rows t of one head for keys j0 .. j0 + n - 1 (n <= 8): one 16-lane dot product per key,
 * eight keys' sums reduced together (v16_sum8, position-independent order). */
ALWAYS_INLINE void score_block(const args_t *a, const float *q, const char *keys[8], long n, float *s, int half) {
    v16 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = v16_zero();
    if (n == 8)
        for (long d = 0; d < a->D; d += 16)
            for (int i = 0; i < 8; i++) acc[i] = fma_kv(q, keys[i], d, half, acc[i]);
    else
        for (long d = 0; d < a->D; d += 16)
            for (int i = 0; i < n; i++) acc[i] = fma_kv(q, keys[i], d, half, acc[i]);
    float sums[8];
    _mm256_storeu_ps(sums, _mm256_mul_ps(v16_sum8(acc), _mm256_set1_ps(a->scale)));
    for (long i = 0; i < n; i++) s[i] = sums[i];
}

/* out rows of RB query rows (t0 ..) for head dims d0 .. d0 + 16 NC: weights times values, and the
 * weights themselves, summed key by key over each row's visible keys in cache order, in registers. */
ALWAYS_INLINE void weigh_values(const args_t *a, const uint8_t *mask, const int64_t *slots, long kvh, const float *s,
                                long t0, int RB, int NC, long d0, float *out_row0, long out_stride, int half) {
    v16 acc[4][4];
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = v16_zero();
    for (long j = 0; j < a->L; j++) {
        const char *v = 0;
        for (int r = 0; r < RB; r++) {
            if (!mask[(t0 + r) * a->L + j]) continue;
            if (!v) v = row_of(a, a->vc, slots, j, kvh, d0);
            float p = s[(t0 + r) * a->Lp + j];
            sum[r] += p;
            for (int c = 0; c < NC; c++) acc[r][c] = axpy_kv(p, v, c, half, acc[r][c]);
        }
    }
    for (int r = 0; r < RB; r++) {
        float inv = sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f; /* no visible key: zeros */
        for (int c = 0; c < NC; c++) v16_store_scaled(out_row0 + r * out_stride + d0 + 16 * c, acc[r][c], inv);
    }
}

#define RB_MAX 4
ALWAYS_INLINE void weigh_rows(const args_t *a, const uint8_t *mask, const int64_t *slots, long kvh, const float *s,
                       long t0, int RB, float *out_row0, long out_stride, int half) {
    for (long d0 = 0; d0 < a->D; d0 += 64) {
        int NC = a->D - d0 >= 64 ? 4 : (int)((a->D - d0) / 16);
        /* constant RB and NC in the common cases, so the accumulators stay in registers */
        if (RB == RB_MAX && NC == 4) weigh_values(a, mask, slots, kvh, s, t0, RB_MAX, 4, d0, out_row0, out_stride, half);
        else if (RB == 1 && NC == 4) weigh_values(a, mask, slots, kvh, s, t0, 1, 4, d0, out_row0, out_stride, half);
        else weigh_values(a, mask, slots, kvh, s, t0, RB, NC, d0, out_row0, out_stride, half);
    }
}

/* All T rows of request b, query head h. */
ALWAYS_INLINE void head(const args_t *a, long b, long h, float *s, int half) {
    const long T = a->T, L = a->L, Lp = a->Lp, kvh = h / (a->H / a->HKV);
    const uint8_t *mask = a->mask + b * T * L;
    const int64_t *slots = a->slots ? a->slots + b * L : 0;
    const float *q = a->q + b * T * a->q_stride + h * a->D;
    for (long j0 = 0; j0 < L; j0 += 8) {
        long n = L - j0 < 8 ? L - j0 : 8;
        const char *keys[8];
        for (long i = 0; i < n; i++) keys[i] = row_of(a, a->kc, slots, j0 + i, kvh, 0);
        for (long t = 0; t < T; t++) {
            const uint8_t *m = mask + t * L + j0;
            int any = 0;
            for (long i = 0; i < n; i++) any |= m[i];
            float *st = s + t * Lp + j0;
            if (any) score_block(a, q + t * a->q_stride, keys, n, st, half);
            for (long i = 0; i < n; i++)
                if (!m[i]) st[i] = -INFINITY;
        }
    }
    for (long t = 0; t < T; t++) {
        float *st = s + t * Lp, lanes[VL], m = -INFINITY;
        for (long j = L; j < Lp; j++) st[j] = -INFINITY;
        vf vm = vset1(-INFINITY); /* masked scores are -inf already; the maximum is exact in any order */
        for (long j = 0; j < Lp; j += VL) vm = vmax(vm, vload(st + j));
        vstore(lanes, vm);
        for (int i = 0; i < VL; i++) m = lanes[i] > m ? lanes[i] : m;
        vm = vset1(m == -INFINITY ? 0.0f : m); /* a row without visible keys: all weights unused */
        for (long j = 0; j < Lp; j += VL) vstore(st + j, vexp_nonpositive(vsub(vload(st + j), vm)));
    }
    long out_stride = a->out_stride;
    float *out0 = a->out + b * T * out_stride + h * a->D;
    long t0 = 0;
    for (; t0 + RB_MAX <= T; t0 += RB_MAX) weigh_rows(a, mask, slots, kvh, s, t0, RB_MAX, out0 + t0 * out_stride, out_stride, half);
    for (; t0 < T; t0++) weigh_rows(a, mask, slots, kvh, s, t0, 1, out0 + t0 * out_stride, out_stride, half);
}

/* The two instantiations: float32 and binary16 caches. */
static void head_f32(const args_t *a, long b, long h, float *s) { head(a, b, h, s, 0); }
static void head_f16(const args_t *a, long b, long h, float *s) { head(a, b, h, s, 1); }

/* A buffer of at least n floats per thread, kept for the thread's later calls (NULL: no memory). */
static float *thread_buffer(size_t n) {
    static _Thread_local float *buf;
    static _Thread_local size_t cap;
    if (n > cap) {
        free(buf);
        buf = malloc(sizeof(float) * n);
        cap = buf ? n : 0;
    }
    return buf;
}

/* Several rows over a binary16 cache (a draft tree, a prompt chunk): the key/value head's keys and
 * values widened once into float32 scratch (exact), then the float32 path, so a value is not
 * widened again for every row, and the query heads sharing the key/value head that the same thread
 * takes next (threads take consecutive heads) reuse the scratch; the bits equal head_f16's. Falls
 * back to head_f16 without memory. */
static void head_f16_rows(const args_t *a, long b, long h, float *s) {
    static _Thread_local long last_call = -1, last_b, last_kvh;
    const long L = a->L, D = a->D, kvh = h / (a->H / a->HKV);
    float *kf = thread_buffer((size_t)(2 * L * D));
    if (!kf) {
        last_call = -1;
        head_f16(a, b, h, s);
        return;
    }
    float *vf = kf + L * D;
    const int64_t *slots = a->slots ? a->slots + b * L : 0;
    int fresh = last_call == a->call && last_b == b && last_kvh == kvh;
    last_call = a->call, last_b = b, last_kvh = kvh;
    for (long j = 0; j < L && !fresh; j++) {
        const uint16_t *k = (const uint16_t *)row_of(a, a->kc, slots, j, kvh, 0);
        const uint16_t *v = (const uint16_t *)row_of(a, a->vc, slots, j, kvh, 0);
        for (long d = 0; d < D; d += VL) {
            vstore(kf + j * D + d, v_from_f16(k + d));
            vstore(vf + j * D + d, v_from_f16(v + d));
        }
    }
    args_t f = *a; /* one request (b's rows), one key/value head, its keys in order at run 0 */
    f.kc = (const char *)kf, f.vc = (const char *)vf, f.slots = 0, f.run_start = 0, f.HKV = 1, f.es = 4;
    f.q = a->q + b * a->T * a->q_stride + kvh * (a->H / a->HKV) * D;
    f.mask = a->mask + b * a->T * L;
    f.out = a->out + b * a->T * a->H * D + kvh * (a->H / a->HKV) * D;
    f.H = a->H / a->HKV;
    head(&f, 0, h % f.H, s, 0);
}

/* q: row (b * T + t) at q + (b * T + t) * q_stride, heads of D floats side by side;
 * kc, vc: the cache [slots, n_kv, D], float32, or binary16 when kv_half is 1; slots: [B, L] int64
 * or NULL (then request b = 0 reads slots run_start .. run_start + L - 1); mask: [B, T, L] bool
 * bytes; out: [B * T, H * D].
 * H must be a multiple of HKV and D a multiple of 16. Returns 0, or -1 when scratch memory could
 * not be allocated (out is then incomplete). Threads split the (request, head) pairs. */
int rd_decode_attention(const float *q, long q_stride, const void *kc, const void *vc, const int64_t *slots,
                        long run_start, const uint8_t *mask, float *out, long B, long T, long L, long H, long HKV,
                        long D, float scale, long kv_half) {
    static long calls;
    args_t a = {q, kc, vc, slots, mask, out, q_stride, H * D, run_start, T, L, (L + 15) / 16 * 16, H, HKV, D,
                kv_half ? 2 : 4, 0, scale};
    long call;
#pragma omp atomic capture
    call = ++calls;
    a.call = call;
    void (*one_head)(const args_t *, long, long, float *) = !kv_half ? head_f32 : T > 1 ? head_f16_rows : head_f16;
    int failed = 0;
#pragma omp parallel if (B * H > 1)
    {
        float *s = malloc(sizeof(float) * (size_t)(T * a.Lp));
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(static)
        for (long b = 0; b < B; b++)
            for (long h = 0; h < H; h++)
                if (s) one_head(&a, b, h, s);
        free(s);
    }
    return failed ? -1 : 0;
}
