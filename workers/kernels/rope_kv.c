/* Rotary position embedding of the new tokens' queries and keys (RoFormer, arXiv 2104.09864,
 * rotate-half convention as in Hugging Face Llama), fused with the KV-cache write:
 *
 *   q_out[n, h]        = rope(q[n, h])          for the n_heads query heads
 *   k_cache[slot[n], g] = rope(k[n, g]),  v_cache[slot[n], g] = v[n, g]   for the n_kv heads
 *   rope(x)[d] = x[d] * cos[n, d] + x[(d + D/2) mod D] * sin_signed[n, d]
 *
 * where q, k, v are the column blocks of the fused QKV projection's output row n and sin_signed is
 * RotaryEmbedding's table (first half negated). Each product and the sum round once, as torch's
 * ``x * cos + rotate_half(x) * sin`` does (no fused multiply-add: the C11 mode this is compiled in
 * does not contract), so the results equal workers.models.rope.apply_rotary's bit for bit.
 *
 * A float16 cache (kv_kind 1) gets each key and value rounded to the nearest IEEE binary16 (ties to
 * even: F16C's vcvtps2ph, as torch's ``.to(torch.float16)`` rounds). An int8 cache (kv_kind 2) gets
 * each token's key/value head as D bytes x and a float32 scale s (to_int8; workers/kv_cache.py's
 * quantize_rows computes the same bits).
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static void rotate(const float *x, const float *c, const float *s, float *y, long D) {
    long half = D / 2;
    for (long d = 0; d < half; d++) y[d] = x[d] * c[d] + x[d + half] * s[d];
    for (long d = half; d < D; d++) y[d] = x[d] * c[d] + x[d - half] * s[d];
}

/* n float32 values to binary16, rounded to nearest even. */
static void to_half(const float *x, uint16_t *y, long n) {
    long i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

/* D float32 values -> an int8 cache row: s = max |x| / 127, y = round(x * (1 / s)) (ties to even,
 * within [-127, 127]), then s's 4 bytes; a row with s below FLT_MIN (all zero) stores y = 0, s = 0,
 * and a row holding a NaN or an infinity y = 0, s = NaN (it reads back as NaN, as a float cache's
 * would). One rounding per operation (this file is compiled without contraction). */
static void to_int8(const float *x, int8_t *y, long D) {
    float m = 0.0f;
    int finite = 1;
    for (long d = 0; d < D; d++) {
        finite &= isfinite(x[d]) != 0;
        m = fabsf(x[d]) > m ? fabsf(x[d]) : m;
    }
    float s = m / 127.0f;
    if (!finite || s < FLT_MIN) {
        memset(y, 0, (size_t)D);
        s = finite ? 0.0f : NAN;
    } else {
        const float inv = 1.0f / s;
        for (long d = 0; d < D; d++) {
            float r = nearbyintf(x[d] * inv);
            y[d] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        }
    }
    memcpy(y + D, &s, sizeof s);
}

/* qkv: [N, (H + 2 HKV) D]; cos, sin_signed: [N, D]; slots: [N] int64; k_cache, v_cache: [slots, HKV, D]
 * float32 (kv_kind 0) or binary16 (1), or [slots, HKV, D + 4] bytes (2: to_int8's rows); q_out:
 * [N, H, D]. D must be even and at most 1024. A slot written twice (padding rows share the trash
 * slot) keeps the later row's values. */
void rd_rope_write_kv(const float *qkv, const float *cos, const float *sin_signed, const int64_t *slots,
                      void *k_cache, void *v_cache, float *q_out, long N, long H, long HKV, long D, long kv_kind) {
    long width = (H + 2 * HKV) * D;
    for (long n = 0; n < N; n++) {
        const float *row = qkv + n * width, *c = cos + n * D, *s = sin_signed + n * D;
        for (long h = 0; h < H; h++) rotate(row + h * D, c, s, q_out + (n * H + h) * D, D);
        if (kv_kind == 2) {
            int8_t *k = (int8_t *)k_cache + slots[n] * HKV * (D + 4), *v = (int8_t *)v_cache + slots[n] * HKV * (D + 4);
            float rotated[1024];
            for (long g = 0; g < HKV; g++) {
                rotate(row + (H + g) * D, c, s, rotated, D);
                to_int8(rotated, k + g * (D + 4), D);
                to_int8(row + (H + HKV + g) * D, v + g * (D + 4), D);
            }
            continue;
        }
        if (!kv_kind) {
            float *k = (float *)k_cache + slots[n] * HKV * D;
            for (long g = 0; g < HKV; g++) rotate(row + (H + g) * D, c, s, k + g * D, D);
            memcpy((float *)v_cache + slots[n] * HKV * D, row + (H + HKV) * D, sizeof(float) * HKV * D);
            continue;
        }
        uint16_t *k = (uint16_t *)k_cache + slots[n] * HKV * D;
        float rotated[1024];
        for (long g = 0; g < HKV; g++) {
            rotate(row + (H + g) * D, c, s, rotated, D);
            to_half(rotated, k + g * D, D);
        }
        to_half(row + (H + HKV) * D, (uint16_t *)v_cache + slots[n] * HKV * D, HKV * D);
    }
}
