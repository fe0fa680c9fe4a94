/* GGUF weights times int8-quantized activations on Intel AMX tiles (AMX-TILE, AMX-INT8), for row
 * blocks of up to 16 rows: draft trees, batched decode rows, prompt chunks. The same computation as
 * vnni_gemm.h, bit for bit: the same weight layout (reorder_for_vnni), the same quantized
 * activations (int8_linear.h), the same exact integer sum D per row, output column and k-block of
 * 32, and the same float32 operations per output:
 *   total = 0;  for b in increasing order: total = fma(fma(d, D, m * A), s[b], total);  total + bias
 * Only how D is computed differs: one TDPBSUD (signed bytes of tile A times unsigned bytes of tile
 * B, 4 products summed into each int32 of tile C; Intel SDM, "TDPBSUD") per half panel and k-block
 * instead of 8 vpdpbusd per row. Each k-block needs its own D (the weights' d, m and the
 * activations' s change per block), so C is zeroed, multiplied over K = 32 bytes, stored to L1 and
 * scaled per block, as llama.cpp's AMX path does for its block formats (ggml-cpu/amx/mmq.cpp).
 *
 * Tiles (palette 1), in two sets for alternate k-blocks: tmm0, tmm1 (set 1: tmm4, tmm5): C, mr x 16
 * int32 (rows of the panel 0-15, 16-31); tmm2 (tmm6): A, the mr quantized activation rows of the
 * block (mr x 32 int8, stride K); tmm3 (tmm7): B, the block's 8 groups of 4 k (8 x 64 uint8) for
 * rows 0-15, then reloaded for rows 16-31. Q8_0's layout holds them as they are (row g of half h at
 * 64 + 128 g + 64 h); Q4_1's nibble pairs are split into a 1 KB scratch per set first.
 *
 * The kernels carry AMX_TARGET and use tile instructions: call them only where the CPU has amx_tile
 * and amx_int8 (and the VNNI kernels' flags), the process was granted the tile state
 * (rd_amx_request, int8_amx.c), and amx_setup(mr) configured the thread's tiles for their mr rows
 * (int8_linear_setup has it called per thread and row count, and the tiles released after the
 * thread's last call, so other code on the thread, oneDNN's AMX GEMMs, never sees a configuration
 * of ours).
 */
#ifndef RD_AMX_GEMM_H
#define RD_AMX_GEMM_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "vnni_gemm.h"

#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,amx-tile,amx-int8")))
#define AMX_ROWS 16 /* the most rows of a tile */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* Configure this thread's tiles for mr rows, or release them (mr = 0). */
static AMX_TARGET void amx_setup(int mr) {
    if (!mr) {
        _tile_release();
        return;
    }
    amx_tilecfg cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int set = 0; set < 2; set++) { /* set 0: tmm0-2, set 1: tmm4-6 */
        cfg.rows[4 * set] = cfg.rows[4 * set + 1] = (uint8_t)mr; /* C, both halves */
        cfg.colsb[4 * set] = cfg.colsb[4 * set + 1] = 64;
        cfg.rows[4 * set + 2] = (uint8_t)mr; /* A */
        cfg.colsb[4 * set + 2] = KBLOCK;
        cfg.rows[4 * set + 3] = KBLOCK / 4; /* B: tmm3 (rows 0-15), tmm7 (rows 16-31) */
        cfg.colsb[4 * set + 3] = 64;
    }
    /* not _tile_loadconfig: GCC 12's tells the compiler it reads 8 bytes, and the other stores to
     * cfg were dropped as dead (a #GP, SIGSEGV, on ldtilecfg); this operand is the whole struct */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

/* Block b's B operands: Q8_0's as stored (stride 128), Q4_1's nibbles split into `split` first. */
static inline __attribute__((always_inline)) AMX_TARGET const uint8_t *
amx_b_operands(const int fmt, const uint8_t *blk, uint8_t split[2][KBLOCK / 4][64], long *stride) {
    if (fmt != VNNI_Q4_1) {
        *stride = 128;
        return blk + 64;
    }
    for (int g = 0; g < KBLOCK / 4; g++) {
        __m512i q0, q1;
        group_operands(fmt, blk, g, &q0, &q1);
        _mm512_store_si512(split[0][g], q0);
        _mm512_store_si512(split[1][g], q1);
    }
    *stride = 64;
    return &split[0][0][0];
}

/* Issue block b's products into tile set SET: C tiles C0, C1, A tile TA (literal tile numbers: the
 * intrinsics paste them into the instruction). */
#define AMX_ISSUE(SET, C0, C1, TA, TB, b)                                                                                 \
    do {                                                                                                    \
        long stride;                                                                                        \
        const uint8_t *blk = w + (b) * block_bytes;                                                         \
        for (int line = 0; line < block_bytes; line += 64)                                                  \
            _mm_prefetch((const char *)blk + PREFETCH_BYTES + line, _MM_HINT_T0);                           \
        const uint8_t *bq = amx_b_operands(fmt, blk, split[SET], &stride);                                  \
        _tile_zero(C0);                                                                                     \
        _tile_zero(C1);                                                                                     \
        _tile_loadd(TA, a + (b) * KBLOCK, K);                                                               \
        _tile_loadd(TB, bq, stride);                                                                        \
        _tile_dpbsud(C0, TA, TB);                                                                           \
        _tile_loadd(TB, bq + (stride == 128 ? 64 : 512), stride);                                          \
        _tile_dpbsud(C1, TA, TB);                                                                           \
    } while (0)

#define AMX_STORE(SET, C0, C1)                                                                              \
    do {                                                                                                    \
        _tile_stored(C0, dot[SET][0], 64);                                                                  \
        _tile_stored(C1, dot[SET][1], 64);                                                                  \
    } while (0)

/* mr (1..16) quantized rows (a: stride K; scale, asum: stride K / 32) times one panel w into y (row
 * stride ldy, first nvalid columns), + bias when not NULL: vnni_rows' contract. Software-pipelined
 * over k-blocks: block b + 1's tile products are issued before block b's results are scaled, in
 * the other tile set, so the tile unit and the vector units overlap. */
static inline __attribute__((always_inline)) AMX_TARGET void
amx_rows(const int fmt, const int mr, const int8_t *a, const float *scale, const float *asum, long K,
         const uint8_t *w, const float *bias, float *y, long ldy, long nvalid) {
    const long nb = K / KBLOCK;
    const int block_bytes = vnni_block_bytes(fmt);
    float total[AMX_ROWS][PANEL] __attribute__((aligned(64)));
    int32_t dot[2][2][AMX_ROWS][16] __attribute__((aligned(64)));      /* [set][half][row][column] */
    uint8_t split[2][2][KBLOCK / 4][64] __attribute__((aligned(64))); /* [set] Q4_1's B operands */
    memset(total, 0, (size_t)mr * sizeof(total[0]));
    AMX_ISSUE(0, 0, 1, 2, 3, 0);
    for (long b = 0; b < nb; b++) {
        const int set = (int)(b & 1);
        if (set == 0) {
            if (b + 1 < nb) AMX_ISSUE(1, 4, 5, 6, 7, b + 1);
            AMX_STORE(0, 0, 1);
        } else {
            if (b + 1 < nb) AMX_ISSUE(0, 0, 1, 2, 3, b + 1);
            AMX_STORE(1, 4, 5);
        }
        __m512 d0, d1, m0, m1;
        block_scales(fmt, w + b * block_bytes, &d0, &d1, &m0, &m1);
        for (int m = 0; m < mr; m++) /* vnni_rows' operations, in its order */
            add_block(total[m], _mm512_load_si512(dot[set][0][m]), _mm512_load_si512(dot[set][1][m]),
                      scale[m * nb + b], asum[m * nb + b], d0, d1, m0, m1);
    }
    store_rows(mr, total, bias, y, ldy, nvalid);
}

/* NAME##_k1 .. NAME##_k16: amx_rows for FMT with 1..16 rows, and NAME##_kernels[1..16]. */
#define AMX_KERNEL(NAME, FMT, MR)                                                                           \
    static AMX_TARGET void NAME##_k##MR(const int8_t *a, const float *scale, const float *asum, long K,       \
                                        const uint8_t *w, const float *bias, float *y, long ldy, long nvalid) { \
        amx_rows(FMT, MR, a, scale, asum, K, w, bias, y, ldy, nvalid); }
#define AMX_KERNELS(NAME, FMT)                                                                              \
    AMX_KERNEL(NAME, FMT, 1) AMX_KERNEL(NAME, FMT, 2) AMX_KERNEL(NAME, FMT, 3) AMX_KERNEL(NAME, FMT, 4)       \
    AMX_KERNEL(NAME, FMT, 5) AMX_KERNEL(NAME, FMT, 6) AMX_KERNEL(NAME, FMT, 7) AMX_KERNEL(NAME, FMT, 8)       \
    AMX_KERNEL(NAME, FMT, 9) AMX_KERNEL(NAME, FMT, 10) AMX_KERNEL(NAME, FMT, 11) AMX_KERNEL(NAME, FMT, 12)    \
    AMX_KERNEL(NAME, FMT, 13) AMX_KERNEL(NAME, FMT, 14) AMX_KERNEL(NAME, FMT, 15) AMX_KERNEL(NAME, FMT, 16)   \
    static const int8_kernel NAME##_kernels[AMX_ROWS + 1] = {NULL, NAME##_k1, NAME##_k2, NAME##_k3, NAME##_k4, \
        NAME##_k5, NAME##_k6, NAME##_k7, NAME##_k8, NAME##_k9, NAME##_k10, NAME##_k11, NAME##_k12, NAME##_k13,  \
        NAME##_k14, NAME##_k15, NAME##_k16};

#endif
