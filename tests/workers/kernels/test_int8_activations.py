"""The int8-activation kernels (``QuantLinear.enable_int8_activations``): ``amx``
(workers/kernels/amx_gemm.h, int8_amx.c; AMX tiles for row blocks of 8-10 rows or more, VNNI below),
``vnni`` (workers/kernels/vnni_gemm.h: q4_1_vnni.c, q8_0_vnni.c; AVX512-VNNI) and ``avx2``
(int8_avx2.c; any CPU the kernels load on). The layout keeps every weight, they compute exactly the
int8 activations they document (llama.cpp's Q8_1 quantization), their error against float64 is
that of int8 activations, a row's result is independent of M, its neighbours, the row block and the
thread count, on each instruction-set build (``isa`` fixture), and the three kernels give the same
bits. Tests that should reach the AMX tiles send at least 16 rows."""

from __future__ import annotations

import numpy as np
import pytest
from compute_paths import require_both_builds
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from workers.kernels import build
from workers.kernels.gguf_blocks import dequantize_panels, panels_from_blocks, reorder_for_vnni
from workers.kernels.prefill_bf16 import prefill_linear
from workers.kernels.quant_linear import INT8_CPU_FLAGS, INT8_KERNELS, QuantLinear, amx_unavailable

FORMATS = ("Q4_1", "Q8_0")
# rows per block: amx_gemm.h's AMX_ROWS, vnni_gemm.h's ROWS, int8_avx2.c's ROWS_Q8_0_AVX2 (Q4_1: 6);
# the test below sends 2 * ROWS + 9 rows, so every block size up to ROWS is reached
ROWS = {"amx": 16, "vnni": 12, "avx2": 8}
NO_VNNI = build.missing_cpu_flags(INT8_CPU_FLAGS)


def kernel_unavailable(kernel: str) -> str | None:
    """The skip reason of an int8 kernel this machine cannot run, or None."""
    if kernel == "vnni" and NO_VNNI:
        return f"needs AVX512-VNNI (this CPU lacks {', '.join(NO_VNNI)})"
    if kernel == "amx" and amx_unavailable():
        return f"needs AMX-INT8 ({amx_unavailable()})"
    return None


@pytest.fixture(params=list(INT8_KERNELS))
def kernel(request):
    """The int8 kernel under test; ``vnni`` only where the CPU has AVX512-VNNI, ``amx`` where it has
    AMX-TILE and AMX-INT8 and Linux grants the tile state."""
    reason = kernel_unavailable(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


def gguf_blocks(fmt: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """gguf-py's blocks of a random ``[n, k]`` matrix and their float64 dequantization."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) / k**0.5
    blocks = quantize(w, GGMLQuantizationType[fmt])
    return blocks, dequantize(blocks, GGMLQuantizationType[fmt]).reshape(n, k).astype(np.float64)


def int8_layer(fmt: str, n: int, k: int, kernel: str, seed: int = 0, bias: bool = False) -> tuple[QuantLinear, np.ndarray]:
    blocks, w = gguf_blocks(fmt, n, k, seed)
    lin = QuantLinear(fmt, blocks, k, torch.randn(n) if bias else None)
    lin.enable_int8_activations(kernel)
    return lin, w


def int8_activations(x: np.ndarray) -> np.ndarray:
    """float32 ``[M, K]`` -> float64 ``s * a``, the activations the kernels multiply by (their
    quantization, operation by operation in float32: s = max|x| / 127, a = rint(x * (1 / s))
    clamped to [-127, 127], blocks with a zero or subnormal s set to 0)."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    s = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    tiny = s < np.finfo(np.float32).tiny
    inv = np.float32(1) / np.where(tiny, np.float32(1), s)
    a = np.where(tiny, 0, np.clip(np.rint(xb * inv), -127, 127))
    return (a * np.where(tiny, 0, s).astype(np.float64)).reshape(m, k)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(1, 32), (70, 64), (96, 576), (33, 1536)])
def test_vnni_layout_keeps_every_value(fmt, n, k):
    blocks, w = gguf_blocks(fmt, n, k)
    panels = panels_from_blocks(fmt, blocks)
    before = panels.clone()
    reorder_for_vnni(fmt, panels)
    scales = 128 if fmt == "Q4_1" else 64
    assert panels.shape == before.shape and torch.equal(panels[..., :scales], before[..., :scales])
    assert not torch.equal(panels, before)
    assert torch.equal(dequantize_panels(fmt, panels, n, vnni=True), torch.from_numpy(w.astype(np.float32)))


def integer_blocks(fmt: str, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Blocks with d = 1 (and m = -8) holding the integers ``q`` ([n, k]; Q4_1 0..15, Q8_0
    -128..127), and the integer weights they stand for."""
    n, k = q.shape
    if fmt == "Q4_1":
        raw = np.zeros((n, k // 32, 20), np.uint8)
        raw[..., 2:4] = np.full((n, k // 32, 1), -8.0, np.float16).view(np.uint8)
        qb = q.reshape(n, k // 32, 32)
        raw[..., 4:] = qb[..., :16] | (qb[..., 16:] << 4)
        w = q - 8
    else:
        raw = np.zeros((n, k // 32, 34), np.uint8)
        raw[..., 2:] = q.astype(np.int8).view(np.uint8).reshape(n, k // 32, 32)
        w = q
    raw[..., 0:2] = np.full((n, k // 32, 1), 1.0, np.float16).view(np.uint8)
    return raw.reshape(n, -1), w


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(70, 64), (40, 576)])
def test_exact_when_every_value_is_an_integer(fmt, n, k, isa, kernel):
    """Integer weights and activations with max |x| = 127 in every block: s = 1, a = x, and every
    product and sum is an exact float32 integer, so the result is the integer matmul bit for bit
    (checks the layouts, the Q8_0 sign offset and the operand order of vpdpbusd / vpmaddubsw exactly)."""
    rng = np.random.default_rng(k)
    blocks, w = integer_blocks(fmt, rng.integers(0, 16, (n, k)) if fmt == "Q4_1" else rng.integers(-128, 128, (n, k)))
    lin = QuantLinear(fmt, blocks, k)
    lin.enable_int8_activations(kernel)
    x = rng.integers(-127, 128, (21, k))  # 16 rows (the AMX tiles) and 5 (the VNNI kernel)
    x.reshape(21, k // 32, 32)[:, :, 0] = 127
    got = lin(torch.from_numpy(x.astype(np.float32)))
    assert torch.equal(got, torch.from_numpy((x @ w.T).astype(np.float32)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_extreme_products_do_not_saturate(fmt, isa, kernel):
    """The largest integer sums each kernel can meet, exactly: every weight at its extreme (Q4_1 15,
    Q8_0 -128 and 127) times activations of +-127 of both signs (vpmaddubsw's int16 pairs and the
    AVX2 kernel's int16 block sums are where a wrong bound would saturate)."""
    k = 64
    for q in ([15, 0] if fmt == "Q4_1" else [-128, 127]):
        blocks, w = integer_blocks(fmt, np.full((32, k), q))
        lin = QuantLinear(fmt, blocks, k)
        lin.enable_int8_activations(kernel)
        x = np.tile([np.full(k, 127), np.full(k, -127), np.tile([127, -127], k // 2)], (6, 1))  # 18 rows
        got = lin(torch.from_numpy(x.astype(np.float32)))
        assert torch.equal(got, torch.from_numpy((x @ w.T).astype(np.float32))), q


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k,bias", [(70, 64, True), (960, 576, False), (100, 1536, True)])
def test_computes_the_documented_int8_quantization(fmt, n, k, bias, isa, kernel):
    """Against float64 on the dequantized weights times the activations quantized as documented:
    only the float32 rounding of the per-block sums remains (~2e-7 of the output's scale), far
    below what one activation rounded the other way would change (~1e-3)."""
    lin, w = int8_layer(fmt, n, k, kernel, seed=n + k, bias=bias)
    for m in (1, 3, 13, 29):
        x = torch.randn(m, k)
        got = lin(x).double().numpy()
        want = int8_activations(x.numpy()) @ w.T + (0 if lin.bias is None else lin.bias.double().numpy())
        assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max(), f"m={m}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(960, 576), (3072, 576), (576, 1536)])
def test_error_against_float64_is_that_of_int8_activations(fmt, n, k, isa, kernel):
    """Relative error (Frobenius) of the whole output against float64 on the dequantized weights and
    the float32 activations: measured 0.53-0.58% on these shapes with Gaussian activations (each
    activation rounded to 1/254 of its block's range), as llama.cpp's Q8_1 activations give."""
    lin, w = int8_layer(fmt, n, k, kernel, seed=k)
    x = torch.randn(16, k)
    got = lin(x).double().numpy()
    want = x.double().numpy() @ w.T
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 1e-3 < rel < 1e-2, rel


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_and_subnormal_blocks_contribute_nothing(fmt, isa, kernel):
    lin, w = int8_layer(fmt, 70, 128, kernel, bias=True)
    x = torch.randn(16, 128)
    x[0, 32:64] = 0.0  # an all-zero block: scale 0, no NaN
    x[1] = 0.0  # a zero row: exactly the bias
    x[2, 64:96] = 1e-39  # subnormal scale: treated as zero
    x[3, :32] = torch.randn(32) * 1e-30  # tiny but normal scale: quantized like any other
    got = lin(x)
    assert torch.isfinite(got).all()
    assert torch.equal(got[1], lin.bias)
    cleared = x[2].clone()
    cleared[64:96] = 0.0
    assert torch.equal(got[2], lin(cleared[None])[0])
    want = int8_activations(x.numpy()) @ w.T + lin.bias.double().numpy()
    assert np.abs(got.double().numpy() - want).max() <= 2e-6 * np.abs(want).max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_row_is_independent_of_the_others_and_of_the_threads(fmt, isa, kernel):
    """Whatever M, the rows batched with it, the register block (ROWS rows) it lands in and the
    thread count: a draft-tree row computes what a plain decode row computes, bit for bit."""
    lin, _ = int8_layer(fmt, 3 * 32 + 7, 576, kernel)
    rows = ROWS[kernel]
    x = torch.randn(2 * rows + 9, 576)
    together = lin(x)
    for i in range(x.shape[0]):
        assert torch.equal(lin(x[i : i + 1])[0], together[i])
    for a, b in [(0, 3), (4, 21), (rows - 1, 2 * rows + 1), (5, 2 * rows + 9)]:
        assert torch.equal(lin(x[a:b]), together[a:b]), f"rows {a}:{b}"
    order = torch.randperm(x.shape[0])
    assert torch.equal(lin(x[order]), together[order])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert torch.equal(lin(x), together), f"{t} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", FORMATS)
def test_both_builds_compute_the_same_bits(fmt, kernel, monkeypatch):
    require_both_builds()
    blocks, _ = gguf_blocks(fmt, 200, 1536)
    x = torch.randn(19, 1536)
    outs = []
    for isa in ("avx512", "avx2"):
        monkeypatch.setenv("RDSERVE_CPU_ISA", isa)
        lin = QuantLinear(fmt, blocks, 1536)
        lin.enable_int8_activations(kernel)
        outs.append(lin(x))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_int8_kernels_compute_the_same_bits(fmt, isa):
    """The AVX2 and AMX kernels are the VNNI kernel's twins: same quantization, same exact integer
    sums (AVX2's Q8_0 through |qs| and the moved sign instead of qs + 128; AMX's by tile products
    per k-block), same float32 operations per output, for every row count around the AMX row
    blocks (16 rows, the VNNI kernel below 10 rows for Q4_1, 8 for Q8_0)."""
    runnable = [k for k in INT8_KERNELS if not kernel_unavailable(k)]
    if len(runnable) < 2:
        pytest.skip(kernel_unavailable("vnni") or "needs a second int8 kernel")
    blocks, _ = gguf_blocks(fmt, 200, 1536)
    x = torch.randn(41, 1536) * torch.logspace(-3, 3, 41)[:, None]
    x[3, :64] = 0.0
    bias = torch.randn(200)
    outs = {}
    for kernel in runnable:
        lin = QuantLinear(fmt, blocks, 1536, bias)
        lin.enable_int8_activations(kernel)
        outs[kernel] = [lin(x[:m]) for m in (1, 7, 8, 9, 10, 16, 17, 19, 25, 26, 41)]
    first = runnable[0]
    for kernel in runnable[1:]:
        for got, want in zip(outs[kernel], outs[first]):
            assert torch.equal(got, want), f"{kernel} vs {first}, {got.shape[0]} rows"


def test_weight_state_dict_and_prefill_rows_are_unchanged(isa, kernel):
    """Enabling keeps the dequantized weight; prompt rows still take the bfloat16 path, the others
    the int8 kernel."""
    blocks, w = gguf_blocks("Q4_1", 160, 576)
    lin = QuantLinear("Q4_1", blocks, 576, torch.randn(160))
    lin.enable_bf16_prefill()
    lin.enable_int8_activations(kernel)
    lin.enable_int8_activations(kernel)  # idempotent: the panels are reordered once
    assert torch.equal(lin.weight, torch.from_numpy(w.astype(np.float32)))
    assert torch.equal(lin.state_dict()["weight"], lin.weight)
    assert "int8_activations=True" in repr(lin)
    x = torch.randn(10, 576)
    decode = lin(x)
    mixed = lin(x, prefill_rows=4)
    assert torch.equal(mixed[:4], prefill_linear(x[:4], lin.prefill_weight, lin.bias))
    assert torch.equal(mixed[4:], decode[4:])
    rows = torch.tensor([1, 7])
    rest = torch.tensor([0, 2, 3, 4, 5, 6, 8, 9])
    picked = lin(x, prefill_rows=rows)
    assert torch.equal(picked[rows], prefill_linear(x[rows], lin.prefill_weight, lin.bias))
    assert torch.equal(picked[rest], decode[rest])


def test_the_vnni_kernel_needs_avx512_vnni_and_the_default_falls_back(isa, monkeypatch):
    blocks, _ = gguf_blocks("Q4_1", 32, 64)
    lin = QuantLinear("Q4_1", blocks, 64)
    panels = lin.panels.clone()
    flags = build._cpu_flags().replace(" avx512_vnni", "")
    monkeypatch.setattr(build, "_cpu_flags", lambda: flags)
    with pytest.raises(build.KernelUnavailable, match="needs AVX512-VNNI; this CPU lacks avx512_vnni"):
        lin.enable_int8_activations("vnni")
    assert not lin.int8_activations and torch.equal(lin.panels, panels)  # still on the float32 kernel
    with pytest.raises(ValueError, match="int8 kernel must be one of amx, vnni, avx2, got 'sse'"):
        lin.enable_int8_activations("sse")
    lin.enable_int8_activations()
    assert lin.int8_activations and lin.int8_kernel == "avx2" and "int8_kernel=avx2" in repr(lin)


def test_the_amx_kernel_needs_amx_and_can_be_switched_off(isa, monkeypatch):
    """Without AMX-TILE / AMX-INT8 the amx kernel is refused naming what is missing and the default
    falls back to vnni; with ``RDSERVE_AMX=0`` too (before asking Linux for the tile state)."""
    blocks, _ = gguf_blocks("Q8_0", 32, 64)
    lin = QuantLinear("Q8_0", blocks, 64)
    flags = build._cpu_flags()
    have = set(flags.split())
    claimed = " ".join(sorted(have | {"avx512f", "avx512bw", "avx512_vnni", "amx_tile", "amx_int8"}))
    monkeypatch.setattr(build, "_cpu_flags", lambda: claimed.replace(" amx_int8", ""))
    with pytest.raises(build.KernelUnavailable, match="the amx int8 kernel cannot run: this CPU lacks amx_int8"):
        lin.enable_int8_activations("amx")
    assert not lin.int8_activations
    monkeypatch.setattr(build, "_cpu_flags", lambda: claimed)
    monkeypatch.setenv("RDSERVE_AMX", "0")
    assert amx_unavailable() == "switched off by RDSERVE_AMX"
    with pytest.raises(build.KernelUnavailable, match="switched off by RDSERVE_AMX"):
        lin.enable_int8_activations("amx")
    if isa == "avx512":
        from workers.kernels.quant_linear import best_int8_kernel

        assert best_int8_kernel() == "vnni"


def test_a_compiler_without_amx_still_builds_the_other_kernels(monkeypatch, tmp_path, caplog):
    """A toolchain that cannot assemble AMX (GCC < 11, binutils < 2.36; here a compiler wrapper that
    fails on int8_amx.c unless it is built with -DRD_NO_AMX) still gets every other kernel: the
    library is rebuilt without AMX, says so, and its amx entries compute the VNNI kernel's bits."""
    import ctypes
    import logging
    import shutil

    if not build.available():
        pytest.skip("CPU kernels unavailable here (no C compiler or no AVX2, or RDSERVE_CPU_KERNELS=0)")
    cc = shutil.which("cc")
    wrapper = tmp_path / "cc-without-amx"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -DRD_NO_AMX "*) ;; *int8_amx.c*) '
                       f'echo "Error: no such instruction: tileloadd" >&2; exit 1;; esac\nexec {cc} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("RDSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(wrapper))
    with caplog.at_level(logging.WARNING, logger="workers.kernels.build"):
        path = build.build()
    assert "built without the AMX int8 kernel" in caplog.text and "tileloadd" in caplog.text
    lib = ctypes.CDLL(str(path))
    assert lib.rd_amx_request() == -3
    if NO_VNNI:
        return  # the entries' VNNI bits cannot be computed here; the build and the refusal were checked
    blocks, _ = gguf_blocks("Q8_0", 64, 128)
    lin = QuantLinear("Q8_0", blocks, 128)
    lin.enable_int8_activations("vnni")
    x = torch.randn(20, 128)
    fn = getattr(lib, "rd_linear_q8_0_amx")
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
    fn.restype = ctypes.c_int
    assert torch.equal(build.run_linear(fn, x, lin.panels, None, 128, 64), lin(x))


def test_an_amx_layer_sent_to_a_new_process_works_there(tmp_path):
    """The tile state is the process's: a layer switched to amx here and unpickled in a new Python
    process (which never asked Linux for it) must not die of SIGILL there; its first call asks."""
    import pickle
    import subprocess
    import sys

    reason = kernel_unavailable("amx")
    if reason:
        pytest.skip(reason)
    blocks, _ = gguf_blocks("Q4_1", 96, 576)
    lin = QuantLinear("Q4_1", blocks, 576)
    lin.enable_int8_activations("amx")
    x = torch.randn(20, 576)
    (tmp_path / "job.pkl").write_bytes(pickle.dumps((lin, x)))
    code = ("import pickle, sys, torch; lin, x = pickle.loads(open(sys.argv[1], 'rb').read()); "
            "assert lin.int8_kernel == 'amx'; torch.save(lin(x), sys.argv[2])")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "job.pkl"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # -4: SIGILL
    assert torch.equal(torch.load(tmp_path / "out.pt"), lin(x))
