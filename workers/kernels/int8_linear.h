/* The driver shared by the int8-activation kernels (vnni_gemm.h on AVX512-VNNI, int8_avx2.c on
 * AVX2): quantize x's rows per block of 32 k, then multiply the quantized rows by the weight
 * panels, in row blocks of up to `rows`, each panel's rows while the panel is in cache.
 *
 * Quantized activations (both kernels, identical bits): per row and k-block b, float32 scale
 * s[b] = max|x| / 127, int8 a[k] = round(x[k] * (1 / s[b])) (half to even, clamped to [-127, 127]),
 * exact sum A[b] = sum_k a[k]; a block with s[b] < FLT_MIN gets s[b] = 0, a = 0 (vnni_gemm.h).
 * For finite x. A NaN in a block may or may not reach its maximum (maxps returns its second operand
 * when either is NaN, and the two kernels reduce in different orders), so with NaN activations the
 * two kernels can differ; neither is specified then.
 */
#ifndef RD_INT8_LINEAR_H
#define RD_INT8_LINEAR_H

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define INT8_PANEL 32
#define INT8_KBLOCK 32

/* Blocks first..last - 1 of x (block i: row i / nb, k-block i % nb) -> a[i * 32 ..] int8,
 * scale[i] = s, asum[i] = A. */
typedef void (*int8_quantizer)(const float *x, long first, long last, int8_t *a, float *scale, float *asum);
/* MR quantized rows (a: stride K; scale, asum: stride K / 32) times one panel w into y (row stride
 * ldy, first nvalid columns), + bias[0 .. nvalid) when bias is not NULL. */
typedef void (*int8_kernel)(const int8_t *a, const float *scale, const float *asum, long K, const uint8_t *w,
                            const float *bias, float *y, long ldy, long nvalid);

/* Called by each thread before a kernel call of mr rows when the thread's state is for `ready` rows
 * (0: none yet); returns the row count its state is now for (AMX: loads the tile configuration for
 * mr rows and returns mr, or leaves it and returns ready when mr rows take the VNNI kernel). Called
 * with mr = 0 after the thread's last call when ready is not 0 (AMX: releases the tiles). Or NULL. */
typedef int (*int8_rows_setup)(int mr, int ready);

/* x is quantized by the calling thread when it is at most INT8_SERIAL_BLOCKS blocks (decode steps
 * and small trees: cheaper than a barrier), else by all threads (an equal share of its blocks
 * each); then the threads split the panels. kernels[1..rows] take 1..rows rows; setup (or NULL)
 * as int8_rows_setup says. Returns 0, or -1 (y untouched) when the buffer for the quantized
 * activations cannot be allocated. */
#define INT8_SERIAL_BLOCKS 256
static inline int int8_linear_setup(int8_quantizer quantize, const int8_kernel *kernels, int rows, int8_rows_setup setup,
                                    size_t block_bytes, const float *x, const void *w, const float *bias, float *y,
                                    long M, long K, long N) {
    const long nb = K / INT8_KBLOCK, panels = (N + INT8_PANEL - 1) / INT8_PANEL, blocks = M * nb;
    const size_t panel_bytes = (size_t)nb * block_bytes;
    float *scale = malloc((size_t)blocks * 2 * sizeof(float) + (size_t)M * K);
    if (!scale) return -1;
    float *asum = scale + blocks;
    int8_t *a = (int8_t *)(asum + blocks);
    const int serial = blocks <= INT8_SERIAL_BLOCKS;
    if (serial) quantize(x, 0, blocks, a, scale, asum);
#pragma omp parallel
    {
        if (!serial) { /* every thread or none takes this branch */
            long t = omp_get_thread_num(), T = omp_get_num_threads();
            quantize(x, blocks * t / T, blocks * (t + 1) / T, a, scale, asum);
#pragma omp barrier
        }
        int ready = 0; /* the row count the thread's setup state is for (int8_rows_setup) */
#pragma omp for schedule(static) nowait
        for (long p = 0; p < panels; p++) {
            long n0 = p * INT8_PANEL;
            long nvalid = N - n0 < INT8_PANEL ? N - n0 : INT8_PANEL;
            for (long m0 = 0; m0 < M; m0 += rows) {
                long mr = M - m0 < rows ? M - m0 : rows;
                if (setup && mr != ready) ready = setup((int)mr, ready);
                kernels[mr](a + m0 * K, scale + m0 * nb, asum + m0 * nb, K, (const uint8_t *)w + p * panel_bytes,
                            bias ? bias + n0 : NULL, y + m0 * N + n0, N, nvalid);
            }
        }
        if (setup && ready) setup(0, ready);
    }
    free(scale);
    return 0;
}

static inline int int8_linear(int8_quantizer quantize, const int8_kernel *kernels, int rows, size_t block_bytes,
                              const float *x, const void *w, const float *bias, float *y, long M, long K, long N) {
    return int8_linear_setup(quantize, kernels, rows, NULL, block_bytes, x, w, bias, y, M, K, N);
}

#endif
