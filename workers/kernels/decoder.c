/* A Llama decoder stack's forward in one call, for the float32 CPU path: the same kernels, in the
 * same order, as workers/models/llama.py's LlamaModel.forward with the C kernels on (so the same
 * bits), without a Python call per norm, projection and attention (about 100 us per layer of glue
 * at batch 1: a third of a SmolLM2-135M decode step; BENCHMARKS.md, "Where a decode step goes").
 *
 * Per layer l, with x the residual stream [N, hidden] (updated in place) and h the normed input
 * (first: rd_rms_norm(x, first_norm)):
 *   qkv = qkv_proj(h);  q = RoPE(q), K/V cache[slot] = RoPE(k), v      (rd_rope_write_kv)
 *   att[group rows] = attention(q[group rows]) per group                (rd_decode_attention)
 *   h = rms_norm(x += o_proj(att), post_attention_norm)                 (rd_rms_norm)
 *   h = rms_norm(x += down_proj(silu(gate) * up), next norm)            (gate, up = gate_up_proj(h))
 * where the next norm is layer l + 1's input norm, and the final norm after the last layer.
 *
 * silu(g) * u is rd_silu_mul's (below), which llama.py's MLP also calls on this path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linear_dispatch.h"

void rd_rms_norm(float *x, const float *delta, const float *w, float *out, long rows, long n, float eps);
void rd_rope_write_kv(const float *qkv, const float *cos, const float *sin_signed, const int64_t *slots,
                      void *k_cache, void *v_cache, float *q_out, long N, long H, long HKV, long D, long kv_kind);
int rd_decode_attention(const float *q, long q_stride, const void *kc, const void *vc, const int64_t *slots,
                        long run_start, const uint8_t *mask, float *out, long B, long T, long L, long H, long HKV,
                        long D, float scale, long kv_kind);

/* out[r, i] = silu(gu[r, i]) * gu[r, n + i]: gu [rows, 2 n] (gate, then up), out [rows, n]. A row's
 * tail of n % VL values goes through the same vector operations (padded), so every value rounds the
 * same whatever n, its position and the build. Relative error against exact silu: a few ulp for
 * gates above -87; below, the result is -0 times up (exact silu is under 1e-36 in magnitude there). */
void rd_silu_mul(const float *gu, float *out, long rows, long n) {
    for (long r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        long i = 0;
        for (; i + VL <= n; i += VL) vstore(o + i, vmul(vsilu(vload(g + i)), vload(u + i)));
        if (i < n) {
            float gt[VL] = {0}, ut[VL] = {0}, ot[VL];
            memcpy(gt, g + i, sizeof(float) * (size_t)(n - i));
            memcpy(ut, u + i, sizeof(float) * (size_t)(n - i));
            vstore(ot, vmul(vsilu(vload(gt)), vload(ut)));
            memcpy(o + i, ot, sizeof(float) * (size_t)(n - i));
        }
    }
}

typedef struct {
    rd_lin qkv, o, gate_up, down;
    const float *post_norm, *next_norm; /* [hidden]: post-attention norm, then the next layer's input norm (or the final one) */
    void *k_cache, *v_cache;            /* [cache rows, HKV, D] float32 or binary16, or int8 rows (kv_kind) */
    long kv_kind;
} rd_layer;

typedef struct {
    long start, batch, seq_len, kv_len, run_start; /* rows start .. start + batch * seq_len - 1 */
    const int64_t *slots;                            /* [batch, kv_len] or NULL (run_start ..) */
    const uint8_t *mask;                             /* [batch, seq_len, kv_len] */
} rd_group;

/* x: [N, hidden] (the embeddings; the residual stream, updated in place); h: [N, hidden] out, the
 * final norm of the stream; first_norm: layer 0's input norm [hidden]; cos, sin_signed: [N, D];
 * slot_mapping: [N]; groups tile the rows in order. inter: the MLP width (gate_up has 2 inter
 * outputs). Returns 0, -1 when out of memory, -2 for an unknown linear kind (h is then incomplete;
 * the caches may hold some layers' new keys). */
int rd_decoder_forward(const rd_layer *layers, long n_layers, const rd_group *groups, long n_groups,
                       float *x, float *h, const float *first_norm, const float *cos, const float *sin_signed,
                       const int64_t *slot_mapping, long N, long hidden, long H, long HKV, long D, long inter,
                       float eps, float scale) {
    const long qkv_w = (H + 2 * HKV) * D, att_w = H * D;
    const size_t floats = (size_t)N * (size_t)(qkv_w + 2 * att_w + 2 * hidden + 3 * inter);
    float *qkv = malloc(sizeof(float) * floats);
    if (!qkv) return -1;
    float *q = qkv + N * qkv_w, *att = q + N * att_w, *o = att + N * att_w, *gu = o + N * hidden,
          *act = gu + N * 2 * inter;
    int status = 0;
    rd_rms_norm(x, NULL, first_norm, h, N, hidden, eps);
    for (long l = 0; l < n_layers && !status; l++) {
        const rd_layer *L = layers + l;
        if ((status = linear(&L->qkv, h, qkv, N))) break;
        rd_rope_write_kv(qkv, cos, sin_signed, slot_mapping, L->k_cache, L->v_cache, q, N, H, HKV, D, L->kv_kind);
        for (long g = 0; g < n_groups && !status; g++) {
            const rd_group *G = groups + g;
            status = rd_decode_attention(q + G->start * att_w, att_w, L->k_cache, L->v_cache, G->slots, G->run_start,
                                         G->mask, att + G->start * att_w, G->batch, G->seq_len, G->kv_len, H, HKV, D,
                                         scale, L->kv_kind);
        }
        if (status || (status = linear(&L->o, att, o, N))) break;
        rd_rms_norm(x, o, L->post_norm, h, N, hidden, eps);
        if ((status = linear(&L->gate_up, h, gu, N))) break;
        rd_silu_mul(gu, act, N, inter);
        if ((status = linear(&L->down, act, o, N))) break;
        rd_rms_norm(x, o, L->next_norm, h, N, hidden, eps);
    }
    free(qkv);
    return status;
}
