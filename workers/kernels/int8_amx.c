/* GGUF Q4_1 / Q8_0 weights times int8-quantized activations on Intel AMX (amx_gemm.h), for row
 * blocks of at least AMX_MIN_ROWS_* rows; fewer rows (a decode step of one request, a call's last
 * few rows) take the AVX512-VNNI kernel (vnni_gemm.h), which is faster there: a tile product and its
 * store to L1 cost the same for 1 or 16 rows. Results are vnni_gemm.h's bit for bit.
 *
 * rd_amx_request asks Linux for the tile data state (arch_prctl(ARCH_REQ_XCOMP_PERM,
 * XFEATURE_XTILEDATA), Linux 5.16+; Documentation/arch/x86/xstate.rst): without it the first tile
 * instruction kills the process with SIGILL. The permission is the process's, for all its threads,
 * and a forked child inherits it; the entries ask on a process's first call.
 *
 * Built with -DRD_NO_AMX (a toolchain that cannot assemble AMX), the entries are the VNNI kernel's
 * and rd_amx_request answers -3.
 */
#define _GNU_SOURCE /* syscall */
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

#include "vnni_gemm.h"

VNNI_KERNELS(q4_1_vnni_rows, VNNI_Q4_1)
VNNI_KERNELS(q8_0_vnni_rows, VNNI_Q8_0)

#ifdef RD_NO_AMX /* a toolchain without AMX (GCC < 11 or binutils < 2.36): build.py retries with this */

int rd_amx_request(void) { return -3; }

int rd_linear_q4_1_amx(const float *x, const void *w, const float *bias, float *y, long M, long K, long N) {
    return int8_linear(quantize_blocks, q4_1_vnni_rows_kernels, ROWS, (size_t)vnni_block_bytes(VNNI_Q4_1), x, w,
                       bias, y, M, K, N);
}

int rd_linear_q8_0_amx(const float *x, const void *w, const float *bias, float *y, long M, long K, long N) {
    return int8_linear(quantize_blocks, q8_0_vnni_rows_kernels, ROWS, (size_t)vnni_block_bytes(VNNI_Q8_0), x, w,
                       bias, y, M, K, N);
}

#else

#include "amx_gemm.h"

/* Row blocks of fewer rows take the VNNI kernel: a tile product and its store to L1 cost the same for
 * 1 or 16 rows, and the VNNI kernel is faster below these counts (measured, one core of a Xeon with
 * AMX: BENCHMARKS.md section 14, "AMX int8 tiles"). */
#define AMX_MIN_ROWS_Q4_1 10
#define AMX_MIN_ROWS_Q8_0 8

AMX_KERNELS(q4_1_amx, VNNI_Q4_1)
AMX_KERNELS(q8_0_amx, VNNI_Q8_0)

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

/* int8_rows_setup: tiles only for the row counts that take them (a VNNI row block leaves them). */
static AMX_TARGET int setup_rows(int mr, int ready, int min_rows) {
    if (mr == 0 || mr >= min_rows) {
        amx_setup(mr);
        return mr;
    }
    return ready;
}
static int q4_1_setup(int mr, int ready) { return setup_rows(mr, ready, AMX_MIN_ROWS_Q4_1); }
static int q8_0_setup(int mr, int ready) { return setup_rows(mr, ready, AMX_MIN_ROWS_Q8_0); }

/* This process's tile state: 0 not asked yet, 1 granted, -errno (or -1000) refused. */
static int amx_state;

/* 0 when this process may use the AMX tiles (granted now or before); otherwise the negated errno of
 * the refusal (EINVAL: no AMX or a kernel before 5.16; EPERM: a sandbox such as seccomp), or -1000
 * when Linux grants but does not report the state. Safe to call from any thread, any number of times. */
int rd_amx_request(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state == 0) {
        unsigned long granted = 0;
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA))
            state = errno ? -errno : -1000;
        else if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted) || !(granted & (1UL << XFEATURE_XTILEDATA)))
            state = -1000;
        else
            state = 1;
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state == 1 ? 0 : state;
}

/* x: [M, K]; w: q4_1_vnni.c's layout; bias: [N] or NULL; y: [M, N]. Returns 0, or -1 when out of
 * memory. Asks for the tile state on this process's first call (a layer built in another process,
 * e.g. unpickled in a spawned worker, would otherwise die of SIGILL) and takes the VNNI kernel,
 * the same bits, where it is refused. */
int rd_linear_q4_1_amx(const float *x, const void *w, const float *bias, float *y, long M, long K, long N) {
    const size_t bytes = (size_t)vnni_block_bytes(VNNI_Q4_1);
    if (M < AMX_MIN_ROWS_Q4_1 || rd_amx_request())
        return int8_linear(quantize_blocks, q4_1_vnni_rows_kernels, ROWS, bytes, x, w, bias, y, M, K, N);
    return int8_linear_setup(quantize_blocks, q4_1_mixed, AMX_ROWS, q4_1_setup, bytes, x, w, bias, y, M, K, N);
}

/* As rd_linear_q4_1_amx, on q8_0_vnni.c's layout. */
int rd_linear_q8_0_amx(const float *x, const void *w, const float *bias, float *y, long M, long K, long N) {
    const size_t bytes = (size_t)vnni_block_bytes(VNNI_Q8_0);
    if (M < AMX_MIN_ROWS_Q8_0 || rd_amx_request())
        return int8_linear(quantize_blocks, q8_0_vnni_rows_kernels, ROWS, bytes, x, w, bias, y, M, K, N);
    return int8_linear_setup(quantize_blocks, q8_0_mixed, AMX_ROWS, q8_0_setup, bytes, x, w, bias, y, M, K, N);
}

#endif
