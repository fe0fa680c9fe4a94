"""Compile and load the C kernels of :mod:`workers.kernels` once per machine.

The shared library is built with the system C compiler (``$CC``, default ``cc``) for the host CPU
(``-O3 -march=native -fopenmp``) into ``$RDSERVE_CACHE/kernels/`` (default ``~/.cache/rdserve``),
named by a hash of the source, flags and compiler, and reused by every later process (Serve
replicas, MPI ranks, tests). It links the OpenMP runtime torch already loaded, so it uses torch's
threads (``torch.set_num_threads``). Set ``RDSERVE_CPU_KERNELS=0`` to use torch's own GEMM instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from workers.models.pull import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("packed_gemm.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


class KernelUnavailable(RuntimeError):
    """The C kernels cannot be used here (disabled, no compiler, or the build failed)."""


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    path = shutil.which(cc)
    if path is None:
        raise KernelUnavailable(f"no C compiler {cc!r} on PATH (set $CC, or RDSERVE_CPU_KERNELS=0)")
    return path


def library_path() -> Path:
    """Where the library for this source, these flags and this compiler lives (built or not).

    Raises:
        KernelUnavailable: no C compiler.
    """
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version]).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"packed_gemm-{key}.so"


def build() -> Path:
    """Compile the library unless it is already in the cache; returns its path.

    The build writes a temporary file and renames it, so concurrent processes never load a
    half-written library.

    Raises:
        KernelUnavailable: no compiler, or the compiler failed (its message is included).
    """
    target = library_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([_compiler(), *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120)
        if proc.returncode:
            raise KernelUnavailable(f"compiling {SOURCE.name} failed:\n{proc.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> ctypes.CDLL:
    """The loaded kernel library (built on first use; a failure is remembered, not retried).

    Raises:
        KernelUnavailable: disabled with ``RDSERVE_CPU_KERNELS=0``, or it cannot be built.
    """
    if os.environ.get("RDSERVE_CPU_KERNELS", "1").lower() in ("0", "off", "false", "no"):
        raise KernelUnavailable("disabled by RDSERVE_CPU_KERNELS")
    lib, error = _load_once()
    if error is not None:
        raise error
    return lib


@cache
def _load_once() -> tuple[ctypes.CDLL | None, KernelUnavailable | None]:
    import torch  # noqa: F401  (load torch's OpenMP runtime first, so the library shares it)

    try:
        lib = ctypes.CDLL(str(build()))
    except KernelUnavailable as e:
        return None, e
    except (OSError, subprocess.SubprocessError) as e:
        return None, KernelUnavailable(f"cannot build or load the kernel library: {e}")
    lib.rd_linear_packed.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
    lib.rd_linear_packed.restype = None
    lib.rd_panel_width.restype = ctypes.c_int
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
