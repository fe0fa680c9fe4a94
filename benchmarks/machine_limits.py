"""The machine's limits that a decoding step is measured against: memory read bandwidth and int8 multiply-add peak.

- **Read bandwidth** (GB/s): a buffer of ``--mib`` MiB (far larger than the caches) summed with 64-byte
  loads, on 1 thread and on every thread (OpenMP), best of ``--repeats``. A step that streams the
  weights once can go no faster than weight bytes / this.
- **int8 peak** (G multiply-adds/s per core): a loop of independent multiply-add instructions on
  registers only, the instruction each kernel path uses: ``vpdpbusd`` on 512-bit registers
  (AVX512-VNNI, 64 multiply-adds each) and, on 256-bit registers (the AVX2 path, 32 each),
  ``vpmaddubsw`` + ``vpmaddwd`` + ``vpaddd`` (Q8_0's products: each widened to int32) and ``vpmaddubsw``
  + ``vpaddw`` (Q4_1's: summed in int16, widened once per block; 1.7x the other's rate on Zen 3, where
  ``vpmaddwd`` takes the multiply units too). Where the CPU lacks an instruction set its row says so.
- **AMX int8** (where the CPU has AMX-INT8 and Linux grants the tile state): ``tdpbsud`` on full tiles
  (16 x 16 x 64 bytes: 16,384 multiply-adds each, independent accumulators), and as rdserve's AMX
  kernel must use it on GGUF blocks (``workers/kernels/amx_gemm.h``): K = 32 per product (a block's
  own scale) and every product's 16 x 16 result stored to L1 for rescaling; the second row is the
  ceiling of that kernel's integer part.

Then, from the default model's shapes (SmolLM2-135M: 30 layers of Q4_1 linears plus the Q8_0 LM head),
what a step must at least cost: weight bytes / bandwidth, and multiply-adds per row / peak.

Compiled with the system C compiler (``cc``) at run time, like the engine's kernels.

Usage: python benchmarks/machine_limits.py [--mib 1024] [--repeats 5] [--out benchmarks/results/machine_limits]
(prints a Markdown table naming the CPU, writes JSON)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_report import write_report

from workers.kernels.build import cpu_model, missing_cpu_flags

C_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <omp.h>
#include <unistd.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

/* bytes/s reading n bytes of buf with `threads` threads (sum of 64-byte loads, kept alive) */
double read_bw(const uint8_t *buf, long n, int threads) {
    double t0 = now();
    long long total = 0;
    #pragma omp parallel for num_threads(threads) reduction(+:total) schedule(static)
    for (long i = 0; i < n; i += 256) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(buf + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(buf + i + 64));
        __m256i c = _mm256_loadu_si256((const __m256i *)(buf + i + 128));
        __m256i d = _mm256_loadu_si256((const __m256i *)(buf + i + 192));
        __m256i s = _mm256_add_epi8(_mm256_add_epi8(a, b), _mm256_add_epi8(c, d));
        total += _mm256_extract_epi64(s, 0);
    }
    double dt = now() - t0;
    volatile long long sink = total; (void)sink;
    return n / dt;
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
double vnni_peak(long iters) {
    /* 8 independent accumulators; the instructions are written out (inline assembly) so the compiler
       can neither hoist the product nor fold the loop */
    __m512i c0 = _mm512_set1_epi32(0), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
    double t0 = now();
    for (long k = 0; k < iters; k++)
        __asm__ volatile(
            "vpdpbusd %8, %9, %0\n\tvpdpbusd %8, %9, %1\n\tvpdpbusd %8, %9, %2\n\tvpdpbusd %8, %9, %3\n\t"
            "vpdpbusd %8, %9, %4\n\tvpdpbusd %8, %9, %5\n\tvpdpbusd %8, %9, %6\n\tvpdpbusd %8, %9, %7"
            : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5), "+v"(c6), "+v"(c7) : "v"(b), "v"(a));
    double dt = now() - t0;
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                                 _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
    volatile int keep = _mm512_reduce_add_epi32(s); (void)keep;
    return 8.0 * 64.0 * iters / dt;
}

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

/* 0 when Linux grants this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA) */
int amx_request(void) { return (int)syscall(158 /* SYS_arch_prctl */, 0x1023, 18); }

/* int8 multiply-adds/s of tdpbsud on one core: 4 independent accumulators over tiles of 16 rows and
   k_bytes (64: full tiles; 32: one GGUF block), each product's result stored to L1 when store */
__attribute__((target("amx-tile,amx-int8")))
double amx_peak(long iters, int k_bytes, int store) {
    static int8_t a[16 * 64] __attribute__((aligned(64)));
    static uint8_t b[16 * 64] __attribute__((aligned(64)));
    static int32_t c[4][16 * 16] __attribute__((aligned(64)));
    tilecfg cfg;
    for (unsigned i = 0; i < sizeof cfg; i++) ((uint8_t *)&cfg)[i] = 0;
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }                 /* C: tmm0-3 */
    cfg.rows[4] = 16; cfg.colsb[4] = (uint16_t)k_bytes;                                   /* A: tmm4 */
    cfg.rows[5] = (uint8_t)(k_bytes / 4); cfg.colsb[5] = 64;                              /* B: tmm5 */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm4" : : "r"(a), "r"(64L));
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm5" : : "r"(b), "r"(64L));
    __asm__ volatile("tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\ttilezero %%tmm3" : :);
    double t0 = now();
    for (long k = 0; k < iters; k++) {
        __asm__ volatile("tdpbsud %%tmm5, %%tmm4, %%tmm0\n\ttdpbsud %%tmm5, %%tmm4, %%tmm1\n\t"
                         "tdpbsud %%tmm5, %%tmm4, %%tmm2\n\ttdpbsud %%tmm5, %%tmm4, %%tmm3" : : : "memory");
        if (store)
            __asm__ volatile("tilestored %%tmm0, (%0,%4,1)\n\ttilestored %%tmm1, (%1,%4,1)\n\t"
                             "tilestored %%tmm2, (%2,%4,1)\n\ttilestored %%tmm3, (%3,%4,1)"
                             : : "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]), "r"(64L) : "memory");
    }
    double dt = now() - t0;
    __asm__ volatile("tilerelease" : :);
    return 4.0 * 16 * 16 * k_bytes * iters / dt;
}

__attribute__((target("avx2")))
double avx2_peak(long iters) {
    /* 4 independent chains of vpmaddubsw -> vpmaddwd -> vpaddd (the AVX2 kernels' int8 dot product) */
    __m256i c0 = _mm256_set1_epi32(0), c1 = c0, c2 = c0, c3 = c0, t0r, t1r, t2r, t3r;
    __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
    double t0 = now();
    for (long k = 0; k < iters; k++)
        __asm__ volatile(
            "vpmaddubsw %9, %8, %4\n\tvpmaddubsw %9, %8, %5\n\tvpmaddubsw %9, %8, %6\n\tvpmaddubsw %9, %8, %7\n\t"
            "vpmaddwd %10, %4, %4\n\tvpmaddwd %10, %5, %5\n\tvpmaddwd %10, %6, %6\n\tvpmaddwd %10, %7, %7\n\t"
            "vpaddd %4, %0, %0\n\tvpaddd %5, %1, %1\n\tvpaddd %6, %2, %2\n\tvpaddd %7, %3, %3"
            : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3), "=&x"(t0r), "=&x"(t1r), "=&x"(t2r), "=&x"(t3r)
            : "x"(b), "x"(a), "x"(ones));
    double dt = now() - t0;
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3));
    volatile int keep = _mm256_extract_epi32(s, 0); (void)keep;
    return 4.0 * 32.0 * iters / dt;
}

__attribute__((target("avx2")))
double avx2_q4_peak(long iters) {
    /* 8 independent chains of vpmaddubsw -> vpaddw (the AVX2 Q4_1 kernel's inner loop: int16 sums,
     * widened once per block, so no vpmaddwd per product) */
    __m256i c0 = _mm256_set1_epi16(0), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
    __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
    double t0 = now();
    for (long k = 0; k < iters; k++)
        __asm__ volatile(
            "vpmaddubsw %9, %8, %%ymm14\n\tvpaddw %%ymm14, %0, %0\n\tvpmaddubsw %9, %8, %%ymm15\n\tvpaddw %%ymm15, %1, %1\n\t"
            "vpmaddubsw %9, %8, %%ymm14\n\tvpaddw %%ymm14, %2, %2\n\tvpmaddubsw %9, %8, %%ymm15\n\tvpaddw %%ymm15, %3, %3\n\t"
            "vpmaddubsw %9, %8, %%ymm14\n\tvpaddw %%ymm14, %4, %4\n\tvpmaddubsw %9, %8, %%ymm15\n\tvpaddw %%ymm15, %5, %5\n\t"
            "vpmaddubsw %9, %8, %%ymm14\n\tvpaddw %%ymm14, %6, %6\n\tvpmaddubsw %9, %8, %%ymm15\n\tvpaddw %%ymm15, %7, %7"
            : "+x"(c0), "+x"(c1), "+x"(c2), "+x"(c3), "+x"(c4), "+x"(c5), "+x"(c6), "+x"(c7)
            : "x"(b), "x"(a) : "xmm14", "xmm15");
    double dt = now() - t0;
    __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(c0, c1), _mm256_add_epi16(c2, c3)),
                                 _mm256_add_epi16(_mm256_add_epi16(c4, c5), _mm256_add_epi16(c6, c7)));
    volatile int keep = _mm256_extract_epi32(s, 0); (void)keep;
    return 8.0 * 32.0 * iters / dt;
}
"""

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
LAYER_MACS = HIDDEN * (960 + HIDDEN + 2 * INTER) + INTER * HIDDEN  # qkv, o, gate_up, down per row
Q4_1_BYTES, Q8_0_BYTES = 20 / 32, 34 / 32  # bytes per weight as shipped


def build(tmp: Path) -> ctypes.CDLL:
    src, lib = tmp / "limits.c", tmp / "limits.so"
    src.write_text(C_SOURCE)
    subprocess.run(["cc", "-O3", "-fopenmp", "-mavx2", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    so = ctypes.CDLL(str(lib))
    so.read_bw.restype = so.vnni_peak.restype = so.avx2_peak.restype = so.avx2_q4_peak.restype = so.amx_peak.restype = ctypes.c_double
    so.read_bw.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    so.vnni_peak.argtypes = so.avx2_peak.argtypes = so.avx2_q4_peak.argtypes = [ctypes.c_long]
    so.amx_peak.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_int]
    return so


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="buffer read for the bandwidth, MiB")
    ap.add_argument("--repeats", type=int, default=5, help="best of this many runs of each measurement")
    ap.add_argument("--out", default="benchmarks/results/machine_limits", help="output path without suffix")
    args = ap.parse_args()
    flags = {f for f in ('avx2', 'avx512f', 'avx512bw', 'avx512_vnni', 'amx_tile', 'amx_int8', 'amx_bf16')
             if not missing_cpu_flags({f})}
    threads = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        so = build(Path(tmp))
        n = args.mib << 20
        buf = (ctypes.c_uint8 * n)()
        ctypes.memset(buf, 1, n)
        bw1 = max(so.read_bw(buf, n, 1) for _ in range(args.repeats))
        bwn = max(so.read_bw(buf, n, threads) for _ in range(args.repeats))
        vnni = max(so.vnni_peak(20_000_000) for _ in range(args.repeats)) if {"avx512f", "avx512bw", "avx512_vnni"} <= flags else None
        avx2 = max(so.avx2_peak(20_000_000) for _ in range(args.repeats)) if "avx2" in flags else None
        avx2_q4 = max(so.avx2_q4_peak(20_000_000) for _ in range(args.repeats)) if "avx2" in flags else None
        amx = amx_block = None
        if {"amx_tile", "amx_int8"} <= flags and so.amx_request() == 0:
            amx = max(so.amx_peak(2_000_000, 64, 0) for _ in range(args.repeats))
            amx_block = max(so.amx_peak(2_000_000, 32, 1) for _ in range(args.repeats))
    weight_bytes = LAYERS * LAYER_MACS * Q4_1_BYTES + VOCAB * HIDDEN * Q8_0_BYTES
    row_macs = LAYERS * LAYER_MACS + VOCAB * HIDDEN
    results = {"command": shlex.join(["python", *sys.argv]), "cpu": cpu_model(), "threads": threads,
               "read_gb_s_1_thread": bw1 / 1e9, "read_gb_s_all_threads": bwn / 1e9,
               "vnni_gmacs_per_core": vnni / 1e9 if vnni else None, "avx2_gmacs_per_core": avx2 / 1e9 if avx2 else None,
               "avx2_q4_1_gmacs_per_core": avx2_q4 / 1e9 if avx2_q4 else None,
               "amx_gmacs_per_core": amx / 1e9 if amx else None,
               "amx_block_stored_gmacs_per_core": amx_block / 1e9 if amx_block else None,
               "default_model": {"weight_mb": weight_bytes / 1e6, "row_gmacs": row_macs / 1e9,
                                 "step_floor_ms_bandwidth": 1e3 * weight_bytes / bwn,
                                 "row_floor_ms_vnni_all_cores": 1e3 * row_macs / (vnni * threads) if vnni else None,
                                 # Q4_1 layers at the Q4_1 products' rate, the Q8_0 LM head at Q8_0's
                                 "row_floor_ms_avx2_all_cores": 1e3 * (LAYERS * LAYER_MACS / avx2_q4 + VOCAB * HIDDEN / avx2)
                                 / threads if avx2 else None,
                                 "rows16_floor_ms_amx_block_all_cores":
                                     1e3 * 16 * row_macs / (amx_block * threads) if amx_block else None}}
    d = results["default_model"]
    fmt = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    table = "\n".join([
        f"CPU: {results['cpu']}, {threads} threads; flags: "
        f"{' '.join(sorted(flags))}", "",
        "| limit | 1 thread | all threads |", "|---|---|---|",
        f"| memory read GB/s | {bw1 / 1e9:.1f} | {bwn / 1e9:.1f} |",
        f"| int8 G multiply-adds/s, AVX512-VNNI vpdpbusd | {fmt(vnni and vnni / 1e9)} | {fmt(vnni and vnni * threads / 1e9)} |",
        f"| int8 G multiply-adds/s, AVX2 vpmaddubsw + vpmaddwd + vpaddd (Q8_0's products) | {fmt(avx2 and avx2 / 1e9)} | "
        f"{fmt(avx2 and avx2 * threads / 1e9)} |",
        f"| int8 G multiply-adds/s, AVX2 vpmaddubsw + vpaddw (Q4_1's products) | {fmt(avx2_q4 and avx2_q4 / 1e9)} | "
        f"{fmt(avx2_q4 and avx2_q4 * threads / 1e9)} |",
        f"| int8 G multiply-adds/s, AMX tdpbsud, full tiles | {fmt(amx and amx / 1e9)} | {fmt(amx and amx * threads / 1e9)} |",
        f"| int8 G multiply-adds/s, AMX as on GGUF blocks (K 32, each result stored) | {fmt(amx_block and amx_block / 1e9)} | "
        f"{fmt(amx_block and amx_block * threads / 1e9)} |",
        "", f"SmolLM2-135M as shipped: {d['weight_mb']:.0f} MB of weights per step (Q4_1 layers, Q8_0 LM head), "
        f"{d['row_gmacs']:.3f} G multiply-adds per row. Floors on all threads: a step streams the weights in "
        f"{d['step_floor_ms_bandwidth']:.2f} ms; a row's multiply-adds take {fmt(d['row_floor_ms_vnni_all_cores'], '.3f')} ms "
        f"(VNNI), {fmt(d['row_floor_ms_avx2_all_cores'], '.3f')} ms (AVX2: the layers at Q4_1's rate, the head at Q8_0's); 16 rows' integer products on AMX "
        f"tiles as the GGUF kernel uses them {fmt(d['rows16_floor_ms_amx_block_all_cores'], '.2f')} ms (before "
        "their rescaling in vector registers)."])
    print(table)
    write_report(args.out, table, results)


if __name__ == "__main__":
    main()
