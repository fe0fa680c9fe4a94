/* GGUF Q4_1 / Q8_0 weights times int8-quantized activations on Intel AMX (amx_gemm.h), for calls of
 * row blocks of at least AMX_MIN_ROWS_* rows; fewer rows (a decode step of one request, a call's
 * last few rows) take the AVX512-VNNI kernel (vnni_gemm.h), which is faster there: a tile product
 * and its store to L1 cost the same for 1 or 16 rows. Results are vnni_gemm.h's bit for bit.
 *
 * rd_amx_request asks Linux for the tile data state (arch_prctl(ARCH_REQ_XCOMP_PERM,
 * XFEATURE_XTILEDATA), Linux 5.16+; Documentation/arch/x86/xstate.rst): without it the first tile
 * instruction kills the process with SIGILL. The permission is the process's, for all its threads.
 */
#define _GNU_SOURCE /* syscall */
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_gemm.h"

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* Row blocks of fewer rows take the VNNI kernel (measured crossover, one core of a Xeon with AMX:
 * BENCHMARKS.md "AMX int8 tiles"): a tile product costs the same for 1 or 16 rows. */
#define AMX_MIN_ROWS_Q4_1 10
#define AMX_MIN_ROWS_Q8_0 8

AMX_KERNELS(q4_1_amx, VNNI_Q4_1)
AMX_KERNELS(q8_0_amx, VNNI_Q8_0)
VNNI_KERNELS(q4_1_vnni_rows, VNNI_Q4_1)
VNNI_KERNELS(q8_0_vnni_rows, VNNI_Q8_0)

/* Per row count: the AMX kernel from the format's minimum up, the VNNI kernel below (a call's
 * last row block, M % 16 rows). */
static const int8_kernel q4_1_mixed[AMX_ROWS + 1] = {
    NULL, q4_1_vnni_rows_k1, q4_1_vnni_rows_k2, q4_1_vnni_rows_k3, q4_1_vnni_rows_k4, q4_1_vnni_rows_k5,
    q4_1_vnni_rows_k6, q4_1_vnni_rows_k7, q4_1_vnni_rows_k8, q4_1_vnni_rows_k9, q4_1_amx_k10, q4_1_amx_k11,
    q4_1_amx_k12, q4_1_amx_k13, q4_1_amx_k14, q4_1_amx_k15, q4_1_amx_k16};
static const int8_kernel q8_0_mixed[AMX_ROWS + 1] = {
    NULL, q8_0_vnni_rows_k1, q8_0_vnni_rows_k2, q8_0_vnni_rows_k3, q8_0_vnni_rows_k4, q8_0_vnni_rows_k5,
    q8_0_vnni_rows_k6, q8_0_vnni_rows_k7, q8_0_amx_k8, q8_0_amx_k9, q8_0_amx_k10, q8_0_amx_k11, q8_0_amx_k12,
    q8_0_amx_k13, q8_0_amx_k14, q8_0_amx_k15, q8_0_amx_k16};
_Static_assert(AMX_MIN_ROWS_Q4_1 == 10 && AMX_MIN_ROWS_Q8_0 == 8, "q4_1_mixed / q8_0_mixed follow the minimums");

/* int8_rows_setup: tiles only for the row counts that take them. */
static AMX_TARGET void q4_1_setup(int mr) { if (mr == 0 || mr >= AMX_MIN_ROWS_Q4_1) amx_setup(mr); }
static AMX_TARGET void q8_0_setup(int mr) { if (mr == 0 || mr >= AMX_MIN_ROWS_Q8_0) amx_setup(mr); }

/* 0 when this process may use the AMX tiles (granted now or before); -1 when the kernel refuses
 * (no AMX, or a kernel before 5.16), -2 when it grants but does not report the state. */
int rd_amx_request(void) {
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return -1;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted) || !(granted & (1UL << XFEATURE_XTILEDATA)))
        return -2;
    return 0;
}

/* x: [M, K]; w: q4_1_vnni.c's layout; bias: [N] or NULL; y: [M, N]. Returns 0, or -1 when out of
 * memory. Only after rd_amx_request returned 0. */
int rd_linear_q4_1_amx(const float *x, const void *w, const float *bias, float *y, long M, long K, long N) {
    const size_t bytes = (size_t)vnni_block_bytes(VNNI_Q4_1);
    if (M < AMX_MIN_ROWS_Q4_1)
        return int8_linear(quantize_blocks, q4_1_vnni_rows_kernels, ROWS, bytes, x, w, bias, y, M, K, N);
    return int8_linear_setup(quantize_blocks, q4_1_mixed, AMX_ROWS, q4_1_setup, bytes, x, w, bias, y, M, K, N);
}

/* As rd_linear_q4_1_amx, on q8_0_vnni.c's layout. */
int rd_linear_q8_0_amx(const float *x, const void *w, const float *bias, float *y, long M, long K, long N) {
    const size_t bytes = (size_t)vnni_block_bytes(VNNI_Q8_0);
    if (M < AMX_MIN_ROWS_Q8_0)
        return int8_linear(quantize_blocks, q8_0_vnni_rows_kernels, ROWS, bytes, x, w, bias, y, M, K, N);
    return int8_linear_setup(quantize_blocks, q8_0_mixed, AMX_ROWS, q8_0_setup, bytes, x, w, bias, y, M, K, N);
}
