/* RMSNorm (Zhang & Sennrich 2019, arXiv 1910.07467), optionally fused with the residual add that
 * precedes it in a pre-norm decoder layer:
 *
 *   x[r] += delta[r]                                  (when delta is not NULL; x is updated in place)
 *   out[r] = (x[r] * (1 / sqrt(mean(x[r]^2) + eps))) * w
 *
 * x, delta, out: [rows, n] contiguous float32; w: [n]. Each row is computed on its own, so a row's
 * result does not depend on the other rows of the call. The sum of squares is taken in 16 lanes
 * (simd.h's v16) and folded in a fixed order, then a scalar tail, so the AVX-512 and AVX2 builds
 * return the same bits. Elementwise products round as torch's RMSNorm does (x * r, then * w); only
 * the order of the sum of squares differs from torch.
 */
#include <math.h>

#include "simd.h"

static void norm_row(float *x, const float *delta, const float *w, float *out, long n, float eps) {
    long vec = n - n % 16;
    if (delta) {
        for (long i = 0; i < vec; i += VL) vstore(x + i, vadd(vload(x + i), vload(delta + i)));
        for (long i = vec; i < n; i++) x[i] += delta[i];
    }
    v16 acc = v16_zero();
    for (long i = 0; i < vec; i += 16) acc = v16_fma(x + i, x + i, acc);
    float ss = v16_sum(acc);
    for (long i = vec; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    vf vr = vset1(r);
    for (long i = 0; i < vec; i += VL) vstore(out + i, vmul(vmul(vload(x + i), vr), vload(w + i)));
    for (long i = vec; i < n; i++) out[i] = (x[i] * r) * w[i];
}

/* x: [rows, n] (updated in place when delta is given); delta: [rows, n] or NULL; w: [n];
 * out: [rows, n], may not alias x. Threads split the rows when there are many. */
void rd_rms_norm(float *x, const float *delta, const float *w, float *out, long rows, long n, float eps) {
#pragma omp parallel for schedule(static) if (rows >= 32)
    for (long r = 0; r < rows; r++)
        norm_row(x + r * n, delta ? delta + r * n : 0, w, out + r * n, n, eps);
}
