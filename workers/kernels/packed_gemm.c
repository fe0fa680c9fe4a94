/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), float32, with W packed in panels of 32 output columns:
 * wp[p][k][j] = W[32 p + j][k] (zero rows pad the last panel), i.e. [ceil(N / 32)][K][32].
 *
 * Why: decoding is bound by streaming the weights from memory, but the GEMM libraries' small-M
 * paths on CPU read them more than once (MKL packs them per call), so verifying a draft tree of
 * 3-17 rows cost up to 2x a single-row step. Here each thread streams its panels once per call
 * (with software prefetch ahead of the stream) and multiplies each k-row of a panel into up to 12
 * input rows held in registers (2 x 16-lane vectors x 12 rows = 24 accumulators).
 *
 * Rounding: every output element is summed the same way whatever M is and whichever row block it
 * falls in: float32 FMA chains over blocks of KBLOCK consecutive k, the block sums added in order,
 * then the bias. So a row's result does not depend on the other rows (plain decoding and tree
 * verification compute bit-identical values for the same input), and the blocked sums keep the
 * error as small as MKL's (logits within 1e-4 of transformers on SmolLM2).
 */
#include <stddef.h>
#include <string.h>

#define PANEL 32
#define ROWS 12
#define KBLOCK 32
#define PREFETCH_K 32

#if !defined(__AVX512F__)
#error "rdserve's packed kernel needs AVX-512; on this CPU torch's GEMM is used instead"
#endif
#include <immintrin.h>

/* Last step of every output row: add the bias, store the first nvalid columns. */
static inline void store_row(float *row, const float *bias, float *y, long nvalid) {
    if (bias)
        for (long j = 0; j < nvalid; j++) row[j] += bias[j];
    memcpy(y, row, (size_t)nvalid * sizeof(float));
}

#define KERNEL(MR)                                                                              \
static void kernel_##MR(const float *x, long K, const float *wp, const float *bias, float *y,  \
                        long ldy, long nvalid) {                                               \
    __m512 acc[MR][2];                                                                          \
    float total[MR][PANEL];                                                                     \
    memset(total, 0, sizeof(total));                                                            \
    for (long k0 = 0; k0 < K; k0 += KBLOCK) {                                                   \
        long k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;                                            \
        for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();               \
        for (long k = k0; k < k1; k++) {                                                        \
            const float *wk = wp + k * PANEL;                                                   \
            _mm_prefetch((const char *)(wk + PREFETCH_K * PANEL), _MM_HINT_T0);                 \
            _mm_prefetch((const char *)(wk + PREFETCH_K * PANEL) + 64, _MM_HINT_T0);            \
            __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);                     \
            for (int m = 0; m < MR; m++) {                                                      \
                __m512 xv = _mm512_set1_ps(x[m * K + k]);                                       \
                acc[m][0] = _mm512_fmadd_ps(w0, xv, acc[m][0]);                                 \
                acc[m][1] = _mm512_fmadd_ps(w1, xv, acc[m][1]);                                 \
            }                                                                                   \
        }                                                                                       \
        for (int m = 0; m < MR; m++) {                                                          \
            _mm512_storeu_ps(total[m], _mm512_add_ps(_mm512_loadu_ps(total[m]), acc[m][0]));    \
            _mm512_storeu_ps(total[m] + 16, _mm512_add_ps(_mm512_loadu_ps(total[m] + 16), acc[m][1])); \
        }                                                                                       \
    }                                                                                           \
    for (int m = 0; m < MR; m++) store_row(total[m], bias, y + m * ldy, nvalid);                \
}

KERNEL(1) KERNEL(2) KERNEL(3) KERNEL(4) KERNEL(5) KERNEL(6)
KERNEL(7) KERNEL(8) KERNEL(9) KERNEL(10) KERNEL(11) KERNEL(12)


/* One row, GROUP panels side by side (GROUP weight streams per thread): plain decoding at batch 1.
 * Same per-element rounding as kernel_1. */
#define GROUP 3
static void kernel_1_group(const float *x, long K, const float *wp, const float *bias, float *y, long nvalid) {
    __m512 total[2 * GROUP];
    for (int i = 0; i < 2 * GROUP; i++) total[i] = _mm512_setzero_ps();
    for (long k0 = 0; k0 < K; k0 += KBLOCK) {
        long k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
        __m512 acc[2 * GROUP];
        for (int i = 0; i < 2 * GROUP; i++) acc[i] = _mm512_setzero_ps();
        for (long k = k0; k < k1; k++) {
            __m512 xv = _mm512_set1_ps(x[k]);
            for (int g = 0; g < GROUP; g++) {
                const float *wk = wp + g * K * PANEL + k * PANEL;
                _mm_prefetch((const char *)(wk + PREFETCH_K * PANEL), _MM_HINT_T0);
                _mm_prefetch((const char *)(wk + PREFETCH_K * PANEL) + 64, _MM_HINT_T0);
                acc[2 * g] = _mm512_fmadd_ps(_mm512_loadu_ps(wk), xv, acc[2 * g]);
                acc[2 * g + 1] = _mm512_fmadd_ps(_mm512_loadu_ps(wk + 16), xv, acc[2 * g + 1]);
            }
        }
        for (int i = 0; i < 2 * GROUP; i++) total[i] = _mm512_add_ps(total[i], acc[i]);
    }
    float out[GROUP * PANEL];
    for (int i = 0; i < 2 * GROUP; i++) _mm512_storeu_ps(out + 16 * i, total[i]);
    store_row(out, bias, y, nvalid);
}

typedef void (*kernel_fn)(const float *, long, const float *, const float *, float *, long, long);
static const kernel_fn KERNELS[ROWS + 1] = {NULL, kernel_1, kernel_2, kernel_3, kernel_4, kernel_5, kernel_6,
                                            kernel_7, kernel_8, kernel_9, kernel_10, kernel_11, kernel_12};

/* x: [M, K] contiguous; wp: packed [ceil(N / 32)][K][32]; bias: [N] or NULL; y: [M, N] contiguous. */
void rd_linear_packed(const float *x, const float *wp, const float *bias, float *y, long M, long K, long N) {
    long panels = (N + PANEL - 1) / PANEL;
    if (M == 1 && panels % GROUP == 0) {
#pragma omp parallel for schedule(static)
        for (long g = 0; g < panels / GROUP; g++) {
            long n0 = g * GROUP * PANEL;
            long nvalid = N - n0 < GROUP * PANEL ? N - n0 : GROUP * PANEL;
            kernel_1_group(x, K, wp + g * GROUP * K * PANEL, bias ? bias + n0 : NULL, y + n0, nvalid);
        }
        return;
    }
#pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++) {
        long n0 = p * PANEL;
        long nvalid = N - n0 < PANEL ? N - n0 : PANEL;
        for (long m0 = 0; m0 < M; m0 += ROWS) {
            long mr = M - m0 < ROWS ? M - m0 : ROWS;
            KERNELS[mr](x + m0 * K, K, wp + p * K * PANEL, bias ? bias + n0 : NULL, y + m0 * N + n0, N, nvalid);
        }
    }
}

int rd_panel_width(void) { return PANEL; }

