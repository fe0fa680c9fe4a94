/* One template for every weight format: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), float32 x, y.
 *
 * W is stored in panels of PANEL = 32 output rows, each panel's k-blocks of KBLOCK = 32 consecutive
 * k one after another (the layouts are in packed_gemm.c, q4_1_gemm.c and q8_0_gemm.c). A kernel
 * call multiplies one panel into a block of up to ROWS input rows held in registers: per k it
 * turns the panel's 32 weights of that k into float32 vectors (a load for float32; a dequantization
 * in registers for the GGUF formats), then does one FMA per input row and vector. With more rows
 * than fit in registers, a quantized panel's k-block is dequantized once into an L1 tile that all
 * the rows read (tiled_panel). Shapes: x [M, K] and y [M, N] row-major float32; bias [N] or NULL.
 *
 * Rounding, the same for every format, instruction set, M and row block: each output element is a
 * float32 FMA chain over each k-block (k in increasing order), the block sums are added in order,
 * then the bias. A row's result therefore never depends on the other rows (plain decoding and
 * draft-tree verification compute bit-identical values for the same input), and since a GGUF
 * block's weights dequantize exactly to float32 (see the format files), a quantized panel gives
 * bit for bit what the float32 kernel gives on the dequantized weights.
 */
#ifndef RD_PANEL_GEMM_H
#define RD_PANEL_GEMM_H

#include <stddef.h>
#include <string.h>

#include "simd.h"

#define PANEL 32
#define KBLOCK 32
#define CHUNK (2 * VL)         /* columns of a panel held in registers at once (2 vectors) */
#define PASSES (PANEL / CHUNK) /* 1 with AVX-512, 2 with AVX2 */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096 /* software prefetch distance ahead of the weight stream */
#endif

enum { FMT_F32, FMT_Q4_1, FMT_Q8_0 };

/* Bytes of one k-block of one panel of the GGUF formats: 32 float16 scales (and for Q4_1 32
 * float16 minimums), then the 32 x 32 quantized weights. */
#define Q4_1_PANEL_BLOCK (64 + 64 + KBLOCK * PANEL / 2)
#define Q8_0_PANEL_BLOCK (64 + KBLOCK * PANEL)

/* Last step of every output row: add the bias, store the first nvalid columns. */
static inline void store_row(float *row, const float *bias, float *y, long nvalid) {
    if (bias)
        for (long j = 0; j < nvalid; j++) row[j] += bias[j];
    memcpy(y, row, (size_t)nvalid * sizeof(float));
}

/* MR input rows (x, row stride K) times one panel w (layout per fmt) into y (row stride ldy). */
static inline __attribute__((always_inline)) void
row_block(const int fmt, const int MR, const float *x, long K, const void *w, const float *bias, float *y,
          long ldy, long nvalid) {
    float total[12][PANEL]; /* MR <= 12 rows; a constant after inlining */
    memset(total, 0, (size_t)MR * sizeof(total[0]));
    for (int pass = 0; pass < PASSES; pass++) {
        const int c = pass * CHUNK;
        for (long k0 = 0, b = 0; k0 < K; k0 += KBLOCK, b++) {
            long k1 = k0 + KBLOCK < K ? k0 + KBLOCK : K;
            vf acc[12][2], s0 = vzero(), s1 = vzero(), o0 = vzero(), o1 = vzero();
            const uint8_t *blk = NULL;
            for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = vzero();
            if (fmt == FMT_Q4_1) {
                blk = (const uint8_t *)w + b * Q4_1_PANEL_BLOCK;
                s0 = v_from_f16((const uint16_t *)blk + c), s1 = v_from_f16((const uint16_t *)blk + c + VL);
                o0 = v_from_f16((const uint16_t *)(blk + 64) + c), o1 = v_from_f16((const uint16_t *)(blk + 64) + c + VL);
                _mm_prefetch((const char *)blk + PREFETCH_BYTES, _MM_HINT_T0);
            } else if (fmt == FMT_Q8_0) {
                blk = (const uint8_t *)w + b * Q8_0_PANEL_BLOCK;
                s0 = v_from_f16((const uint16_t *)blk + c), s1 = v_from_f16((const uint16_t *)blk + c + VL);
                _mm_prefetch((const char *)blk + PREFETCH_BYTES, _MM_HINT_T0);
            }
            for (long k = k0; k < k1; k++) {
                vf w0, w1;
                if (fmt == FMT_F32) {
                    const float *wk = (const float *)w + k * PANEL + c;
                    _mm_prefetch((const char *)wk + PREFETCH_BYTES, _MM_HINT_T0);
                    _mm_prefetch((const char *)wk + PREFETCH_BYTES + 64, _MM_HINT_T0);
                    w0 = vload(wk), w1 = vload(wk + VL);
                } else if (fmt == FMT_Q4_1) {
                    /* byte i of a k-row: column i in the low 4 bits, column 16 + i in the high 4 */
                    const uint8_t *q = blk + 128 + (k - k0) * (PANEL / 2);
                    if ((k - k0) % 4 == 0) _mm_prefetch((const char *)q + PREFETCH_BYTES, _MM_HINT_T0);
                    w0 = vfma(v_from_nibbles(q + c % 16, c >= 16), s0, o0);
                    w1 = vfma(v_from_nibbles(q + (c + VL) % 16, c + VL >= 16), s1, o1);
                } else {
                    const int8_t *q = (const int8_t *)(blk + 64) + (k - k0) * PANEL + c;
                    if ((k - k0) % 2 == 0) _mm_prefetch((const char *)q + PREFETCH_BYTES, _MM_HINT_T0);
                    w0 = vmul(v_from_i8(q), s0), w1 = vmul(v_from_i8(q + VL), s1);
                }
                for (int m = 0; m < MR; m++) {
                    vf xv = vset1(x[m * K + k]);
                    acc[m][0] = vfma(w0, xv, acc[m][0]);
                    acc[m][1] = vfma(w1, xv, acc[m][1]);
                }
            }
            for (int m = 0; m < MR; m++) {
                vstore(total[m] + c, vadd(vload(total[m] + c), acc[m][0]));
                vstore(total[m] + c + VL, vadd(vload(total[m] + c + VL), acc[m][1]));
            }
        }
    }
    for (int m = 0; m < MR; m++) store_row(total[m], bias, y + m * ldy, nvalid);
}

typedef void (*row_kernel)(const float *, long, const void *, const float *, float *, long, long);

/* --- Many rows on quantized panels: dequantize each k-block of a panel once into an L1 tile,
 * then run every block of rows over the tile (the dequantization is shared by all the rows of the
 * call, up to SUPER at a time). Same per-element rounding as row_block. */
#define SUPER 48 /* rows sharing one dequantized tile (a multiple of every ROWS) */

/* The CHUNK columns at offset c of k-block b of a quantized panel -> tile[KBLOCK][CHUNK] float32. */
static inline __attribute__((always_inline)) void
dequantize_tile(const int fmt, const void *w, long b, int c, float *tile) {
    if (fmt == FMT_Q4_1) {
        const uint8_t *blk = (const uint8_t *)w + b * Q4_1_PANEL_BLOCK;
        vf s0 = v_from_f16((const uint16_t *)blk + c), s1 = v_from_f16((const uint16_t *)blk + c + VL);
        vf o0 = v_from_f16((const uint16_t *)(blk + 64) + c), o1 = v_from_f16((const uint16_t *)(blk + 64) + c + VL);
        for (int kk = 0; kk < KBLOCK; kk++) {
            const uint8_t *q = blk + 128 + kk * (PANEL / 2);
            vstore(tile + kk * CHUNK, vfma(v_from_nibbles(q + c % 16, c >= 16), s0, o0));
            vstore(tile + kk * CHUNK + VL, vfma(v_from_nibbles(q + (c + VL) % 16, c + VL >= 16), s1, o1));
        }
    } else {
        const uint8_t *blk = (const uint8_t *)w + b * Q8_0_PANEL_BLOCK;
        vf s0 = v_from_f16((const uint16_t *)blk + c), s1 = v_from_f16((const uint16_t *)blk + c + VL);
        for (int kk = 0; kk < KBLOCK; kk++) {
            const int8_t *q = (const int8_t *)(blk + 64) + kk * PANEL + c;
            vstore(tile + kk * CHUNK, vmul(v_from_i8(q), s0));
            vstore(tile + kk * CHUNK + VL, vmul(v_from_i8(q + VL), s1));
        }
    }
}

/* MR rows of x (stride K, from column k0) times a tile into total (stride PANEL, columns c..). */
static inline __attribute__((always_inline)) void
tile_rows(const int MR, const float *tile, const float *x, long K, long k0, float *total, int c) {
    vf acc[12][2];
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = vzero();
    for (int kk = 0; kk < KBLOCK; kk++) {
        vf w0 = vload(tile + kk * CHUNK), w1 = vload(tile + kk * CHUNK + VL);
        for (int m = 0; m < MR; m++) {
            vf xv = vset1(x[m * K + k0 + kk]);
            acc[m][0] = vfma(w0, xv, acc[m][0]);
            acc[m][1] = vfma(w1, xv, acc[m][1]);
        }
    }
    for (int m = 0; m < MR; m++) {
        float *t = total + m * PANEL + c;
        vstore(t, vadd(vload(t), acc[m][0]));
        vstore(t + VL, vadd(vload(t + VL), acc[m][1]));
    }
}

typedef void (*tile_kernel)(const float *, const float *, long, long, float *, int);
#define TILE_KERNEL(MR) \
    static void tile_k##MR(const float *t, const float *x, long K, long k0, float *total, int c) { \
        tile_rows(MR, t, x, K, k0, total, c); }
TILE_KERNEL(1) TILE_KERNEL(2) TILE_KERNEL(3) TILE_KERNEL(4) TILE_KERNEL(5) TILE_KERNEL(6)
TILE_KERNEL(7) TILE_KERNEL(8) TILE_KERNEL(9) TILE_KERNEL(10) TILE_KERNEL(11) TILE_KERNEL(12)
static const tile_kernel tile_kernels[13] = {NULL, tile_k1, tile_k2, tile_k3, tile_k4, tile_k5, tile_k6,
                                             tile_k7, tile_k8, tile_k9, tile_k10, tile_k11, tile_k12};
#if VL == 16
#define TILE_ROWS 12
#else
#define TILE_ROWS 6
#endif

/* All M rows times one quantized panel (K a multiple of KBLOCK). */
static inline __attribute__((always_inline)) void
tiled_panel(const int fmt, const float *x, long M, long K, const void *w, const float *bias, float *y, long ldy,
            long nvalid) {
    float total[SUPER][PANEL] __attribute__((aligned(64)));
    float tile[KBLOCK * CHUNK] __attribute__((aligned(64)));
    for (long s0 = 0; s0 < M; s0 += SUPER) {
        long sm = M - s0 < SUPER ? M - s0 : SUPER;
        memset(total, 0, (size_t)sm * sizeof(total[0]));
        for (int c = 0; c < PANEL; c += CHUNK)
            for (long b = 0; b < K / KBLOCK; b++) {
                dequantize_tile(fmt, w, b, c, tile);
                for (long m0 = 0; m0 < sm; m0 += TILE_ROWS) {
                    long mr = sm - m0 < TILE_ROWS ? sm - m0 : TILE_ROWS;
                    tile_kernels[mr](tile, x + (s0 + m0) * K, K, b * KBLOCK, total[m0], c);
                }
            }
        for (long m = 0; m < sm; m++) store_row(total[m], bias, y + (s0 + m) * ldy, nvalid);
    }
}

/* A quantized format's entry: rows in registers (dequantizing per row block) for M <= rows,
 * else the tiled path. */
static inline __attribute__((always_inline)) void
quant_linear(const int fmt, const row_kernel *kernels, int rows, size_t block_bytes, const float *x,
             const void *w, const float *bias, float *y, long M, long K, long N) {
    long panels = (N + PANEL - 1) / PANEL;
    size_t panel_bytes = (size_t)(K / KBLOCK) * block_bytes;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++) {
        long n0 = p * PANEL;
        long nvalid = N - n0 < PANEL ? N - n0 : PANEL;
        const char *wp = (const char *)w + p * panel_bytes;
        if (M <= rows)
            kernels[M](x, K, wp, bias ? bias + n0 : NULL, y + n0, N, nvalid);
        else
            tiled_panel(fmt, x, M, K, wp, bias ? bias + n0 : NULL, y + n0, N, nvalid);
    }
}

/* NAME##_k1 .. NAME##_k12: row_block for FMT with 1..12 rows, and NAME##_kernels[1..12]. */
#define ROW_KERNEL(NAME, FMT, MR)                                                                     \
    static void NAME##_k##MR(const float *x, long K, const void *w, const float *bias, float *y, long ldy, \
                             long nvalid) { row_block(FMT, MR, x, K, w, bias, y, ldy, nvalid); }
#define ROW_KERNELS(NAME, FMT)                                                                        \
    ROW_KERNEL(NAME, FMT, 1) ROW_KERNEL(NAME, FMT, 2) ROW_KERNEL(NAME, FMT, 3) ROW_KERNEL(NAME, FMT, 4) \
    ROW_KERNEL(NAME, FMT, 5) ROW_KERNEL(NAME, FMT, 6) ROW_KERNEL(NAME, FMT, 7) ROW_KERNEL(NAME, FMT, 8) \
    ROW_KERNEL(NAME, FMT, 9) ROW_KERNEL(NAME, FMT, 10) ROW_KERNEL(NAME, FMT, 11) ROW_KERNEL(NAME, FMT, 12) \
    static const row_kernel NAME##_kernels[13] = {NULL, NAME##_k1, NAME##_k2, NAME##_k3, NAME##_k4,      \
        NAME##_k5, NAME##_k6, NAME##_k7, NAME##_k8, NAME##_k9, NAME##_k10, NAME##_k11, NAME##_k12};

/* Every panel (threads split the panels) times every block of at most rows input rows. */
static inline void panels_times_rows(const row_kernel *kernels, int rows, const float *x, const void *w,
                                     size_t panel_bytes, const float *bias, float *y, long M, long K, long N) {
    long panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; p++) {
        long n0 = p * PANEL;
        long nvalid = N - n0 < PANEL ? N - n0 : PANEL;
        for (long m0 = 0; m0 < M; m0 += rows) {
            long mr = M - m0 < rows ? M - m0 : rows;
            kernels[mr](x + m0 * K, K, (const char *)w + p * panel_bytes, bias ? bias + n0 : NULL,
                        y + m0 * N + n0, N, nvalid);
        }
    }
}

#endif
