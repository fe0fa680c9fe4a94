/* ReDrafter's draft (arXiv 2403.09919 Sec. 3.1) in one call, for the CPU kernels: the first draft
 * position's top-`width` tokens, each continued greedily to `draft_len` tokens (workers/redrafter/
 * beam_search.py, draft_distinct_first_batch; with one beam or one draft token that is also what
 * ReDrafter's beam search proposes). The Python search runs about 20 torch calls and 5 projections
 * per draft position, ~1 ms at batch 1 on two cores; here the same projections run back to back.
 *
 * Per draft position, for M rows (B at the first position, B * width after it):
 *   s = silu(rnn_w e + b)                  first position (the zero state: rnn_u 0 + b = b)
 *   s = silu(rnn_w e + rnn_u s_prev)       later ones (rnn_u carries the bias b)
 *   x = [context of the row's sequence, s]            [M, 2H]
 *   x = x + silu(block(x))   per residual block
 *   logits = head(out_proj(x))  ("shared" head)  or  head(x)  ("full" head)        [M, V']
 * with e the base model's input embedding of the previous token. The operations are torch's, in
 * torch's order, on the same kernels; SiLU is decoder.c's (a few ulp from torch's), and exact ties
 * are ranked by index, so a near-tie may be broken the other way: only which tokens are proposed
 * can change, never what is accepted.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "linear_dispatch.h"

#define RD_MAX_DRAFT_LAYERS 8

typedef struct {
    rd_lin rnn_w, rnn_u;                 /* [H, H]; rnn_u holds the RNN's bias */
    rd_lin blocks[RD_MAX_DRAFT_LAYERS];  /* residual blocks [2H, 2H] with bias */
    long n_blocks;
    long has_out_proj;                   /* 1: out_proj [H, 2H] then head [V', H]; 0: head [V', 2H] */
    rd_lin out_proj, head;
    const float *embed;                  /* [vocab, H] float32: the base model's input embedding */
    const int64_t *draft_vocab;          /* [V'] head row -> token id, or NULL (V' = vocab) */
    long H, vocab;                       /* hidden size; rows of embed */
} rd_drafter;

/* x[i] = silu(x[i] + add[i]) (add may be NULL) or, with residual, x[i] += silu(add[i]); n values,
 * the tail through the same vector operations (padded). */
static void silu_into(float *x, const float *add, long n, int residual) {
    long i = 0;
    for (; i + VL <= n; i += VL) {
        vf a = add ? vload(add + i) : vzero();
        vstore(x + i, residual ? vadd(vload(x + i), vsilu(a)) : vsilu(add ? vadd(vload(x + i), a) : vload(x + i)));
    }
    if (i < n) {
        float xt[VL] = {0}, at[VL] = {0};
        memcpy(xt, x + i, sizeof(float) * (size_t)(n - i));
        if (add) memcpy(at, add + i, sizeof(float) * (size_t)(n - i));
        vf a = vload(at);
        vstore(xt, residual ? vadd(vload(xt), vsilu(a)) : vsilu(add ? vadd(vload(xt), a) : vload(xt)));
        memcpy(x + i, xt, sizeof(float) * (size_t)(n - i));
    }
}

typedef struct {
    float *x, *t, *y, *e, *s, *s2, *logits;
} scratch;

/* logits[M, V'] for rows (ctx[row_seq[m]], s[m]). */
static int draft_logits(const rd_drafter *d, const float *ctx, const long *row_seq, long M, scratch *w) {
    const long H = d->H, D = 2 * H;
    int status;
    for (long m = 0; m < M; m++) {
        memcpy(w->x + m * D, ctx + row_seq[m] * H, sizeof(float) * (size_t)H);
        memcpy(w->x + m * D + H, w->s + m * H, sizeof(float) * (size_t)H);
    }
    for (long l = 0; l < d->n_blocks; l++) {
        if ((status = linear(&d->blocks[l], w->x, w->t, M))) return status;
        silu_into(w->x, w->t, M * D, 1);
    }
    if (d->has_out_proj) {
        if ((status = linear(&d->out_proj, w->x, w->y, M))) return status;
        return linear(&d->head, w->y, w->logits, M);
    }
    return linear(&d->head, w->x, w->logits, M);
}

/* e[m] = embed[tokens[m]]; -4 when a token is outside the embedding (nothing read then). */
static int gather_embed(const rd_drafter *d, const int64_t *tokens, long M, float *e) {
    for (long m = 0; m < M; m++)
        if (tokens[m] < 0 || tokens[m] >= d->vocab) return -4;
    for (long m = 0; m < M; m++)
        memcpy(e + m * d->H, d->embed + tokens[m] * d->H, sizeof(float) * (size_t)d->H);
    return 0;
}

/* a ranks above b: torch's order (NaN above every number). */
static inline int better(float a, float b) { return (isnan(a) && !isnan(b)) || a > b; }

/* The `width` best of v[0 .. n) by better(), best first; equal values keep index order (torch.topk
 * leaves the order of exact ties unspecified). */
static void top_k(const float *v, long n, long width, long *idx) {
    float best[64];
    long filled = 0;
    for (long i = 0; i < n; i++) {
        if (filled == width && !better(v[i], best[width - 1])) continue;
        long p = filled < width ? filled++ : width - 1;
        while (p > 0 && better(v[i], best[p - 1])) {
            best[p] = best[p - 1];
            idx[p] = idx[p - 1];
            p--;
        }
        best[p] = v[i];
        idx[p] = i;
    }
}

/* sum over i < n of exp(v[i] - vmax), vmax >= every v[i]: a softmax's denominator (vexp_nonpositive;
 * the tail lanes padded with -inf's stand-in, -87, whose exp adds below a float's resolution of 1).
 * NaN when vmax is not finite (a NaN or infinite logit: vexp_nonpositive would clamp the NaN of
 * inf - inf to -87 and give a finite sum). */
static float sum_exp(const float *v, long n, float vmax) {
    if (!isfinite(vmax)) return NAN;
    vf acc = vzero(), m = vset1(vmax);
    long i = 0;
    for (; i + VL <= n; i += VL) acc = vadd(acc, vexp_nonpositive(vsub(vload(v + i), m)));
    if (i < n) {
        float t[VL];
        for (long k = 0; k < VL; k++) t[k] = i + k < n ? v[i + k] - vmax : -87.0f;
        acc = vadd(acc, vexp_nonpositive(vload(t)));
    }
    float lanes[VL], s = 0.0f;
    vstore(lanes, acc);
    for (long k = 0; k < VL; k++) s += lanes[k];
    return s;
}

/* ctx: [B, H] base hidden states; roots: [B] the tokens the base model chose; out: [B, width,
 * draft_len + 1] token ids (column 0 the root), beams ordered by their first draft token's logit;
 * prob (NULL: not computed): [B, width, draft_len] the drafter's softmax probability of each drafted
 * token given the beam's earlier ones (NaN where the logits hold a NaN).
 * width <= 64 and <= V'; draft_len >= 1. Returns 0, -1 when out of memory, -2 for an unknown
 * linear kind, -3 for a width or draft_len out of range, -4 for a token outside the embedding. */
int rd_draft_distinct_first(const rd_drafter *d, const float *ctx, const int64_t *roots, long B, long width,
                            long draft_len, int64_t *out, float *prob) {
    const long H = d->H, V = d->head.N, M = B * width, L = draft_len + 1;
    if (width < 1 || width > 64 || width > V || draft_len < 1) return -3;
    const size_t floats = (size_t)M * (size_t)(2 * 2 * H + 4 * H + V);
    /* the integer arrays first: the floats after them stay 8-byte aligned whatever M and V */
    long *row_seq = malloc(sizeof(long) * (size_t)(2 * M) + sizeof(int64_t) * (size_t)M + sizeof(float) * floats);
    if (!row_seq) return -1;
    long *top = row_seq + M;
    int64_t *tok = (int64_t *)(top + M);
    float *buf = (float *)(tok + M);
    scratch w = {buf, buf + M * 2 * H, buf + M * 4 * H, buf + M * 5 * H, buf + M * 6 * H, buf + M * 7 * H,
                 buf + M * 8 * H};
    int status;
    /* first draft position: B rows */
    for (long b = 0; b < B; b++) row_seq[b] = b;
    if ((status = gather_embed(d, roots, B, w.e)) || (status = linear(&d->rnn_w, w.e, w.s, B))) goto done;
    if (d->rnn_u.bias) {
        for (long b = 0; b < B; b++) silu_into(w.s + b * H, d->rnn_u.bias, H, 0);
    } else {
        silu_into(w.s, NULL, B * H, 0);
    }
    if ((status = draft_logits(d, ctx, row_seq, B, &w))) goto done;
    for (long b = 0; b < B; b++) {
        const float *v = w.logits + b * V;
        top_k(v, V, width, top + b * width);
        const float vmax = v[top[b * width]], sum = prob ? sum_exp(v, V, vmax) : 0.0f;
        for (long k = 0; k < width; k++) {
            long i = top[b * width + k];
            int64_t *o = out + (b * width + k) * L;
            o[0] = roots[b];
            o[1] = tok[b * width + k] = d->draft_vocab ? d->draft_vocab[i] : i;
            if (prob) prob[(b * width + k) * draft_len] = expf(v[i] - vmax) / sum;
        }
    }
    if (draft_len > 1) { /* every beam continues from its sequence's first-position state */
        for (long m = M - 1; m >= 0; m--) {
            row_seq[m] = m / width;
            memcpy(w.s2 + m * H, w.s + (m / width) * H, sizeof(float) * (size_t)H);
        }
        memcpy(w.s, w.s2, sizeof(float) * (size_t)(M * H));
    }
    for (long pos = 2; pos <= draft_len; pos++) {
        if ((status = gather_embed(d, tok, M, w.e)) || (status = linear(&d->rnn_u, w.s, w.s2, M))) goto done;
        if ((status = linear(&d->rnn_w, w.e, w.s, M))) goto done;
        silu_into(w.s, w.s2, M * H, 0);
        if ((status = draft_logits(d, ctx, row_seq, M, &w))) goto done;
        for (long m = 0; m < M; m++) {
            const float *v = w.logits + m * V;
            long best = 0;
            for (long i = 1; i < V; i++)
                if (better(v[i], v[best])) best = i;
            out[m * L + pos] = tok[m] = d->draft_vocab ? d->draft_vocab[best] : best;
            if (prob) prob[m * draft_len + pos - 1] = 1.0f / sum_exp(v, V, v[best]);
        }
    }
done:
    free(row_seq);
    return status;
}
