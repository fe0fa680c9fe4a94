/* What the fused C paths (decoder.c: the decoder stack; drafter.c: the ReDrafter draft head) share:
 * a linear layer's description (one of rdserve's kernels, as workers/kernels/decoder.py's
 * LINEAR_KINDS names them), its dispatch, and SiLU. */
#ifndef RD_LINEAR_DISPATCH_H
#define RD_LINEAR_DISPATCH_H

#include <stdint.h>

#include "simd.h"

void rd_linear_packed(const float *x, const float *wp, const float *bias, float *y, long M, long K, long N);
void rd_linear_q4_1(const float *x, const void *w, const float *bias, float *y, long M, long K, long N);
void rd_linear_q8_0(const float *x, const void *w, const float *bias, float *y, long M, long K, long N);
int rd_linear_q4_1_vnni(const float *x, const void *w, const float *bias, float *y, long M, long K, long N);
int rd_linear_q8_0_vnni(const float *x, const void *w, const float *bias, float *y, long M, long K, long N);
int rd_linear_q4_1_amx(const float *x, const void *w, const float *bias, float *y, long M, long K, long N);
int rd_linear_q8_0_amx(const float *x, const void *w, const float *bias, float *y, long M, long K, long N);
int rd_linear_q4_1_int8_avx2(const float *x, const void *w, const float *bias, float *y, long M, long K, long N);
int rd_linear_q8_0_int8_avx2(const float *x, const void *w, const float *bias, float *y, long M, long K, long N);

/* silu(x) = x * sigmoid(x), sigmoid from e = exp(-|x|): 1 / (1 + e) for x >= 0, e / (1 + e) below;
 * e = 0 for |x| > 87 (vexp_nonpositive stops at exp(-87)), so silu(x) = -0 below -87 (exact: a
 * subnormal or 0) and x above 87; NaN stays NaN, silu(-inf) = NaN as in torch. */
static inline vf vsilu(vf x) {
    const vf one = vset1(1.0f);
    vf nabs = vneg_abs(x);
    vf e = vselect_nonneg(vadd(nabs, vset1(87.0f)), vexp_nonpositive(nabs), vzero());
    return vmul(x, vdiv(vselect_nonneg(x, one, e), vadd(one, e)));
}

/* Linear kinds, as workers/kernels/decoder.py names them. */
enum { LIN_PACKED, LIN_Q4_1, LIN_Q8_0, LIN_Q4_1_VNNI, LIN_Q8_0_VNNI, LIN_Q4_1_I8_AVX2, LIN_Q8_0_I8_AVX2, LIN_Q4_1_AMX,
       LIN_Q8_0_AMX };

typedef struct {
    long kind, K, N;
    const void *w;
    const float *bias;
} rd_lin;

/* y[M, N] = x[M, K] W^T (+ bias). Returns 0, -1 (out of memory) or -2 (an unknown kind). */
static inline int linear(const rd_lin *l, const float *x, float *y, long M) {
    switch (l->kind) {
    case LIN_PACKED: rd_linear_packed(x, l->w, l->bias, y, M, l->K, l->N); return 0;
    case LIN_Q4_1: rd_linear_q4_1(x, l->w, l->bias, y, M, l->K, l->N); return 0;
    case LIN_Q8_0: rd_linear_q8_0(x, l->w, l->bias, y, M, l->K, l->N); return 0;
    case LIN_Q4_1_VNNI: return rd_linear_q4_1_vnni(x, l->w, l->bias, y, M, l->K, l->N);
    case LIN_Q8_0_VNNI: return rd_linear_q8_0_vnni(x, l->w, l->bias, y, M, l->K, l->N);
    case LIN_Q4_1_I8_AVX2: return rd_linear_q4_1_int8_avx2(x, l->w, l->bias, y, M, l->K, l->N);
    case LIN_Q8_0_I8_AVX2: return rd_linear_q8_0_int8_avx2(x, l->w, l->bias, y, M, l->K, l->N);
    case LIN_Q4_1_AMX: return rd_linear_q4_1_amx(x, l->w, l->bias, y, M, l->K, l->N);
    case LIN_Q8_0_AMX: return rd_linear_q8_0_amx(x, l->w, l->bias, y, M, l->K, l->N);
    default: return -2;
    }
}

#endif
