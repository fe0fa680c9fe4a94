/* float32 weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), with W packed in panels of 32 output
 * rows: wp[p][k][j] = W[32 p + j][k] (zero rows pad the last panel), i.e. [ceil(N / 32)][K][32]
 * float32 (workers/kernels/packed_linear.py packs it). Any K.
 *
 * Why: decoding is bound by streaming the weights from memory, but the GEMM libraries' small-M
 * paths on CPU read them more than once (MKL packs them per call), so verifying a draft tree of
 * 3-17 rows cost up to 2x a single-row step. Here each thread streams its panels once per row
 * block (with software prefetch ahead of the stream) and multiplies each k-row of a panel into up
 * to ROWS input rows held in registers. Rounding: see panel_gemm.h (row-independent, the same on
 * both instruction sets).
 */
#include "panel_gemm.h"

#if VL == 16
#define ROWS 12 /* 24 accumulators + 2 weight vectors + x of 32 zmm registers */
#else
#define ROWS 6 /* 12 accumulators + 2 + 1 of 16 ymm registers */
#endif
#define NV (PANEL / VL) /* vectors per k-row of a panel */

ROW_KERNELS(f32, FMT_F32)

/* One row, GROUP panels side by side (GROUP weight streams per thread): plain decoding at batch 1.
 * Same per-element rounding as row_block. */
#define GROUP 3
static void one_row_group(const float *x, long K, const float *wp, const float *bias, float *y, long nvalid) {
    vf total[GROUP * NV];
    for (int i = 0; i < GROUP * NV; i++) total[i] = vzero();
    for (long k0 = 0; k0 < K; k0 += KBLOCK) {
        long k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
        vf acc[GROUP * NV];
        for (int i = 0; i < GROUP * NV; i++) acc[i] = vzero();
        for (long k = k0; k < k1; k++) {
            vf xv = vset1(x[k]);
            for (int g = 0; g < GROUP; g++) {
                const float *wk = wp + g * K * PANEL + k * PANEL;
                _mm_prefetch((const char *)wk + PREFETCH_BYTES, _MM_HINT_T0);
                _mm_prefetch((const char *)wk + PREFETCH_BYTES + 64, _MM_HINT_T0);
                for (int v = 0; v < NV; v++) acc[g * NV + v] = vfma(vload(wk + v * VL), xv, acc[g * NV + v]);
            }
        }
        for (int i = 0; i < GROUP * NV; i++) total[i] = vadd(total[i], acc[i]);
    }
    float out[GROUP * PANEL];
    for (int i = 0; i < GROUP * NV; i++) vstore(out + VL * i, total[i]);
    store_row(out, bias, y, nvalid);
}

/* x: [M, K] contiguous; wp: packed [ceil(N / 32)][K][32]; bias: [N] or NULL; y: [M, N] contiguous. */
void rd_linear_packed(const float *x, const float *wp, const float *bias, float *y, long M, long K, long N) {
    long panels = (N + PANEL - 1) / PANEL;
    if (M == 1 && panels % GROUP == 0) {
#pragma omp parallel for schedule(static)
        for (long g = 0; g < panels / GROUP; g++) {
            long n0 = g * GROUP * PANEL;
            long nvalid = N - n0 < GROUP * PANEL ? N - n0 : GROUP * PANEL;
            one_row_group(x, K, wp + g * GROUP * K * PANEL, bias ? bias + n0 : NULL, y + n0, nvalid);
        }
        return;
    }
    panels_times_rows(f32_kernels, ROWS, x, wp, (size_t)K * PANEL * sizeof(float), bias, y, M, K, N);
}

int rd_panel_width(void) { return PANEL; }

/* "avx512" or "avx2": the instruction set this library was built for. */
const char *rd_isa(void) { return RD_ISA; }
