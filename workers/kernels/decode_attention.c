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
    const float *q, *kc, *vc;
    const int64_t *slots;
    const uint8_t *mask;
    float *out;
    long q_stride, run_start, T, L, Lp, H, HKV, D;
    float scale;
} args_t;

static inline const float *row_of(const args_t *a, const float *cache, const int64_t *slots, long j, long kvh) {
    return cache + ((slots ? slots[j] : a->run_start + j) * a->HKV + kvh) * a->D;
}

/* Scores of rows t of one head for keys j0 .. j0 + n - 1 (n <= 8): one 16-lane dot product per key,
 * eight keys' sums reduced together (v16_sum8, position-independent order). */
static void score_block(const args_t *a, const float *q, const float *keys[8], long n, float *s) {
    v16 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = v16_zero();
    if (n == 8)
        for (long d = 0; d < a->D; d += 16)
            for (int i = 0; i < 8; i++) acc[i] = v16_fma(q + d, keys[i] + d, acc[i]);
    else
        for (long d = 0; d < a->D; d += 16)
            for (int i = 0; i < n; i++) acc[i] = v16_fma(q + d, keys[i] + d, acc[i]);
    float sums[8];
    _mm256_storeu_ps(sums, _mm256_mul_ps(v16_sum8(acc), _mm256_set1_ps(a->scale)));
    for (long i = 0; i < n; i++) s[i] = sums[i];
}

/* out rows of RB query rows (t0 ..) for head dims d0 .. d0 + 16 NC: weights times values, and the
 * weights themselves, summed key by key over each row's visible keys in cache order, in registers. */
static inline void weigh_values(const args_t *a, const uint8_t *mask, const int64_t *slots, long kvh, const float *s,
                                long t0, int RB, int NC, long d0, float *out_row0, long out_stride) {
    v16 acc[4][4];
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = v16_zero();
    for (long j = 0; j < a->L; j++) {
        const float *v = 0;
        for (int r = 0; r < RB; r++) {
            if (!mask[(t0 + r) * a->L + j]) continue;
            if (!v) v = row_of(a, a->vc, slots, j, kvh) + d0;
            float p = s[(t0 + r) * a->Lp + j];
            sum[r] += p;
            for (int c = 0; c < NC; c++) acc[r][c] = v16_axpy(p, v + 16 * c, acc[r][c]);
        }
    }
    for (int r = 0; r < RB; r++) {
        float inv = sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f; /* no visible key: zeros */
        for (int c = 0; c < NC; c++) v16_store_scaled(out_row0 + r * out_stride + d0 + 16 * c, acc[r][c], inv);
    }
}

#define RB_MAX 4
static void weigh_rows(const args_t *a, const uint8_t *mask, const int64_t *slots, long kvh, const float *s,
                       long t0, int RB, float *out_row0, long out_stride) {
    for (long d0 = 0; d0 < a->D; d0 += 64) {
        int NC = a->D - d0 >= 64 ? 4 : (int)((a->D - d0) / 16);
        /* constant RB and NC in the common cases, so the accumulators stay in registers */
        if (RB == RB_MAX && NC == 4) weigh_values(a, mask, slots, kvh, s, t0, RB_MAX, 4, d0, out_row0, out_stride);
        else if (RB == 1 && NC == 4) weigh_values(a, mask, slots, kvh, s, t0, 1, 4, d0, out_row0, out_stride);
        else weigh_values(a, mask, slots, kvh, s, t0, RB, NC, d0, out_row0, out_stride);
    }
}

/* All T rows of request b, query head h. */
static void head(const args_t *a, long b, long h, float *s) {
    const long T = a->T, L = a->L, Lp = a->Lp, kvh = h / (a->H / a->HKV);
    const uint8_t *mask = a->mask + b * T * L;
    const int64_t *slots = a->slots ? a->slots + b * L : 0;
    const float *q = a->q + b * T * a->q_stride + h * a->D;
    for (long j0 = 0; j0 < L; j0 += 8) {
        long n = L - j0 < 8 ? L - j0 : 8;
        const float *keys[8];
        for (long i = 0; i < n; i++) keys[i] = row_of(a, a->kc, slots, j0 + i, kvh);
        for (long t = 0; t < T; t++) {
            const uint8_t *m = mask + t * L + j0;
            int any = 0;
            for (long i = 0; i < n; i++) any |= m[i];
            float *st = s + t * Lp + j0;
            if (any) score_block(a, q + t * a->q_stride, keys, n, st);
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
    long out_stride = a->H * a->D;
    float *out0 = a->out + b * T * out_stride + h * a->D;
    long t0 = 0;
    for (; t0 + RB_MAX <= T; t0 += RB_MAX) weigh_rows(a, mask, slots, kvh, s, t0, RB_MAX, out0 + t0 * out_stride, out_stride);
    for (; t0 < T; t0++) weigh_rows(a, mask, slots, kvh, s, t0, 1, out0 + t0 * out_stride, out_stride);
}

/* q: row (b * T + t) at q + (b * T + t) * q_stride, heads of D floats side by side;
 * kc, vc: the cache [slots, n_kv, D]; slots: [B, L] int64 or NULL (then request b = 0 reads slots
 * run_start .. run_start + L - 1); mask: [B, T, L] bool bytes; out: [B * T, H * D].
 * H must be a multiple of HKV and D a multiple of 16. Returns 0, or -1 when scratch memory could
 * not be allocated (out is then incomplete). Threads split the (request, head) pairs. */
int rd_decode_attention(const float *q, long q_stride, const float *kc, const float *vc, const int64_t *slots,
                        long run_start, const uint8_t *mask, float *out, long B, long T, long L, long H, long HKV,
                        long D, float scale) {
    args_t a = {q, kc, vc, slots, mask, out, q_stride, run_start, T, L, (L + 15) / 16 * 16, H, HKV, D, scale};
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
                if (s) head(&a, b, h, s);
        free(s);
    }
    return failed ? -1 : 0;
}
