"""Compile and load the C kernels of :mod:`workers.kernels` once per machine and instruction set.

Every kernel is built in two variants from the same sources (``simd.h``): ``avx512``
(``-mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c``) and ``avx2``
(``-mavx2 -mfma -mf16c``, no ``-march=native``, so it also runs on AVX-512 CPUs). The variant is
chosen when loading: the best one the CPU's flags allow, or ``RDSERVE_CPU_ISA=avx2`` / ``avx512``
(tests force ``avx2`` to run that path on any machine). Both variants return bit-identical results
(``panel_gemm.h``).

A shared library is built with the system C compiler (``$CC``, default ``cc``) into
``$RDSERVE_CACHE/kernels/`` (default ``~/.cache/rdserve``), named by the variant and a hash of the
sources, flags, compiler and the CPU's instruction-set flags, and reused by every later process on
this machine (Serve replicas, MPI ranks, tests). A new build is loaded once in a child process
before it is published (so a broken library never reaches a server), and a SHA-256 written next to
it is checked before every load (a damaged file is rebuilt). It links the OpenMP runtime torch
already loaded, so it uses torch's threads (``torch.set_num_threads``).

The AVX512-VNNI kernels (``vnni_gemm.h``: ``q4_1_vnni.c``, ``q8_0_vnni.c``) are compiled into both
variants through GCC's / Clang's ``target`` function attribute, not a command-line flag, so each
library still loads on CPUs without VNNI; callers run them only where :func:`missing_cpu_flags`
finds their flags. Their AVX2 twins (``int8_avx2.c``, the same results bit for bit) run anywhere.
So are the AMX kernels (``amx_gemm.h``: ``int8_amx.c``; the same results again), which use tiles
only once ``rd_amx_request`` obtained the tile state from Linux
(:func:`~workers.kernels.quant_linear.amx_unavailable`). They need GCC 11+ (or Clang 12+) and
binutils 2.36+; where the compiler fails on them, the library is built again with ``-DRD_NO_AMX``
(their entries then run the VNNI kernel) and a warning says so.

Without AVX2+FMA+F16C the build is refused and torch's GEMM is used. Set ``RDSERVE_CPU_KERNELS=0``
to use torch's GEMM anyway.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

from workers.models.pull import cache_dir

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = [HERE / "packed_gemm.c", HERE / "q4_1_gemm.c", HERE / "q8_0_gemm.c", HERE / "q4_1_vnni.c",
           HERE / "q8_0_vnni.c", HERE / "int8_amx.c", HERE / "int8_avx2.c", HERE / "rms_norm.c", HERE / "decode_attention.c", HERE / "rope_kv.c", HERE / "decoder.c",
           HERE / "drafter.c", HERE / "argmax.c"]
HEADERS = [HERE / "simd.h", HERE / "panel_gemm.h", HERE / "vnni_gemm.h", HERE / "amx_gemm.h", HERE / "int8_linear.h", HERE / "linear_dispatch.h"]
INT8_ENTRIES = ("rd_linear_q4_1_vnni", "rd_linear_q8_0_vnni", "rd_linear_q4_1_amx", "rd_linear_q8_0_amx",
                "rd_linear_q4_1_int8_avx2", "rd_linear_q8_0_int8_avx2")
FLAGS = ["-O3", "-mtune=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}
ISA_CPU_FLAGS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"},
                 "avx2": {"avx2", "fma", "f16c"}}


class KernelUnavailable(RuntimeError):
    """The C kernels cannot be used here (disabled, no compiler, no AVX2, or the build failed)."""


def supported_isas() -> list[str]:
    """The kernel variants this CPU can run, best first (``["avx512", "avx2"]``, ``["avx2"]`` or ``[]``)."""
    flags = set(_cpu_flags().split())
    return [isa for isa in ISA_FLAGS if ISA_CPU_FLAGS[isa] <= flags]


def missing_cpu_flags(needed: set[str]) -> list[str]:
    """The flags of ``needed`` (as ``/proc/cpuinfo`` spells them, e.g. ``avx512_vnni``) this CPU lacks, sorted."""
    return sorted(needed - set(_cpu_flags().split()))


def active_isa() -> str:
    """The variant to load: ``$RDSERVE_CPU_ISA`` (``auto``, ``avx512``, ``avx2``), by default the best
    this CPU runs.

    Raises:
        KernelUnavailable: an unknown value, a variant this CPU cannot run, or no variant at all.
    """
    want = os.environ.get("RDSERVE_CPU_ISA", "auto").strip().lower() or "auto"
    if want != "auto" and want not in ISA_FLAGS:
        raise KernelUnavailable(f"RDSERVE_CPU_ISA must be auto, avx512 or avx2, got {want!r}")
    have = supported_isas()
    if not have:
        raise KernelUnavailable("this CPU has neither AVX-512 nor AVX2 with FMA and F16C")
    if want == "auto":
        return have[0]
    if want not in have:
        raise KernelUnavailable(f"RDSERVE_CPU_ISA={want} but this CPU lacks "
                                f"{sorted(ISA_CPU_FLAGS[want] - set(_cpu_flags().split()))}")
    return want


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC", "cc")) or ["cc"]
    path = shutil.which(cc[0])
    if path is None:
        raise KernelUnavailable(f"no C compiler {cc[0]!r} on PATH (set $CC, or RDSERVE_CPU_KERNELS=0)")
    return [path, *cc[1:]]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or :func:`platform.processor` where that cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> str:
    """The host's instruction-set flags (``-march=native`` depends on them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def library_path(isa: str | None = None) -> Path:
    """Where the library of variant ``isa`` (default :func:`active_isa`) for these sources, flags,
    compiler and CPU lives (built or not).

    Raises:
        KernelUnavailable: no C compiler, or see :func:`active_isa`.
    """
    isa = isa or active_isa()
    cc = _compiler()
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [f.read_text() for f in SOURCES + HEADERS]
    key = hashlib.sha256("\0".join([*texts, *FLAGS, *ISA_FLAGS[isa], *cc, version, _cpu_flags()]).encode())
    return cache_dir() / "kernels" / f"rdkernels-{isa}-{key.hexdigest()[:16]}.so"


def _digest(path: Path | str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _intact(target: Path) -> bool:
    checksum = target.with_suffix(".sha256")
    try:
        return target.is_file() and checksum.read_text().strip() == _digest(target)
    except OSError:
        return False


def build(isa: str | None = None) -> Path:
    """Compile the library of variant ``isa`` (default :func:`active_isa`) unless an intact copy is
    already in the cache; returns its path.

    The build writes a temporary file, loads it once in a child process, fsyncs it and renames it
    into place, then writes its SHA-256; concurrent builders never expose a half-written file.

    Raises:
        KernelUnavailable: no compiler, the compiler failed (its message is included), or the
            result does not load.
    """
    isa = isa or active_isa()
    target = library_path(isa)
    if _intact(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [*_compiler(), *FLAGS, *ISA_FLAGS[isa], *map(str, SOURCES), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode:  # an older GCC or assembler may lack AMX: the rest of the kernels still build
            retry = subprocess.run([*cmd[:-2], "-DRD_NO_AMX", "-o", tmp], capture_output=True, text=True, timeout=300)
            if retry.returncode:
                raise KernelUnavailable(f"compiling the {isa} kernels failed:\n{proc.stderr.strip()}")
            log.warning("the %s kernels were built without the AMX int8 kernel (this compiler or assembler "
                        "cannot build it; GCC 11+ and binutils 2.36+ can): %s", isa,
                        proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "")
        if os.path.getsize(tmp) == 0:
            raise KernelUnavailable(f"the compiler wrote an empty library for the {isa} kernels")
        check = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({tmp!r}).rd_panel_width()"],
                               capture_output=True, text=True, timeout=60)
        if check.returncode:
            raise KernelUnavailable(f"the built library does not load: {check.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o755)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        digest = _digest(tmp)
        os.replace(tmp, target)
        checksum_tmp = target.with_suffix(f".sha256.{os.getpid()}")
        checksum_tmp.write_text(digest + "\n")
        os.replace(checksum_tmp, target.with_suffix(".sha256"))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> str:
    """Build (first use) and load the variant :func:`active_isa` names; returns its name, to pass to
    :func:`library` (a failure is remembered, not retried).

    Raises:
        KernelUnavailable: disabled with ``RDSERVE_CPU_KERNELS=0``, no AVX2, a bad
            ``RDSERVE_CPU_ISA``, or it cannot be built.
    """
    if os.environ.get("RDSERVE_CPU_KERNELS", "1").lower() in ("0", "off", "false", "no"):
        raise KernelUnavailable("disabled by RDSERVE_CPU_KERNELS")
    isa = active_isa()
    library(isa)
    return isa


def library(isa: str | None = None) -> ctypes.CDLL:
    """The cached handle of variant ``isa`` (default :func:`active_isa`), for hot paths whose module
    was built after :func:`load` succeeded; no ``RDSERVE_CPU_KERNELS`` check.

    Raises:
        KernelUnavailable: it cannot be built or loaded.
    """
    lib, error = _load_once(isa or active_isa())
    if error is not None:
        raise error
    return lib


@cache
def kernel(isa: str, name: str):
    """The ctypes function ``name`` of variant ``isa``'s library (cached: hot paths call it per layer).

    Raises:
        KernelUnavailable: see :func:`library`.
    """
    return getattr(library(isa), name)


def run_linear(fn, x: "torch.Tensor", panels: "torch.Tensor", bias: "torch.Tensor | None", in_features: int,
               out_features: int):
    """``y[..., out_features] = x[..., in_features] @ W^T (+ bias)`` through the C entry point ``fn``
    (any ``rd_linear_*``: ``fn(x, w, bias, y, M, K, N)``, returning nothing, or nonzero when it could
    not allocate its scratch memory). Called ~120 times per decoding step, so a 2-D contiguous ``x``
    is passed as is and ``y`` returned without a view.

    Raises:
        ValueError: ``x``'s last dimension is not ``in_features``.
        MemoryError: the kernel could not allocate its scratch memory.
    """
    import torch

    if x.shape[-1] != in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the layer takes {in_features}")
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, in_features).contiguous()
    M = x2.shape[0]
    y = torch.empty((M, out_features))
    if M and fn(x2.data_ptr(), panels.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(), M,
                in_features, out_features):
        raise MemoryError(f"the kernel could not allocate scratch memory for {M} x {in_features} inputs")
    return y if x2 is x else y.view(*x.shape[:-1], out_features)


@cache
def _load_once(isa: str) -> tuple[ctypes.CDLL | None, KernelUnavailable | None]:
    import torch  # noqa: F401  (load torch's OpenMP runtime first, so the library shares it)

    try:
        lib = ctypes.CDLL(str(build(isa)))
    except KernelUnavailable as e:
        return None, e
    except (OSError, subprocess.SubprocessError) as e:
        return None, KernelUnavailable(f"cannot build or load the kernel library: {e}")
    for name in ("rd_linear_packed", "rd_linear_q4_1", "rd_linear_q8_0", *INT8_ENTRIES):
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
        getattr(lib, name).restype = ctypes.c_int if name in INT8_ENTRIES else None
    P, L, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
    lib.rd_rms_norm.argtypes = [P] * 4 + [L] * 2 + [F]
    lib.rd_rms_norm.restype = None
    lib.rd_argmax_rows.argtypes = [P, L, L, P]
    lib.rd_argmax_rows.restype = None
    lib.rd_decode_attention.argtypes = [P, L, P, P, P, L, P, P] + [L] * 6 + [F, L]
    lib.rd_decode_attention.restype = ctypes.c_int
    lib.rd_rope_write_kv.argtypes = [P] * 7 + [L] * 5
    lib.rd_rope_write_kv.restype = None
    lib.rd_silu_mul.argtypes = [P, P, L, L]
    lib.rd_silu_mul.restype = None
    lib.rd_decoder_forward.argtypes = [P, L, P, L, P, P, P, P, P, P] + [L] * 6 + [F, F]
    lib.rd_decoder_forward.restype = ctypes.c_int
    lib.rd_draft_distinct_first.argtypes = [P, P, P, L, L, L, P, P]
    lib.rd_draft_distinct_first.restype = ctypes.c_int
    lib.rd_panel_width.restype = ctypes.c_int
    lib.rd_amx_request.restype = ctypes.c_int
    lib.rd_isa.restype = ctypes.c_char_p
    return lib, None


def available() -> bool:
    """True when :func:`load` succeeds; logs the reason once when it does not."""
    try:
        load()
        return True
    except KernelUnavailable as e:
        _warn_once(str(e))
        return False


@cache
def _warn_once(reason: str) -> None:
    log.warning("rdserve CPU kernels unavailable, using torch's GEMM: %s", reason)
