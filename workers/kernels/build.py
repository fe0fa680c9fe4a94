"""Compile and load the C kernels of :mod:`workers.kernels` once per machine.

The shared library is built with the system C compiler (``$CC``, default ``cc``) for the host CPU
(``-O3 -march=native -fopenmp``) into ``$RDSERVE_CACHE/kernels/`` (default ``~/.cache/rdserve``),
named by a hash of the source, flags, compiler and the CPU's instruction-set flags, and reused by
every later process on this machine (Serve replicas, MPI ranks, tests). A new build is loaded once
in a child process before it is published (so a broken library never reaches a server), and a
SHA-256 written next to it is checked before every load (a damaged file is rebuilt). It links the
OpenMP runtime torch already loaded, so it uses torch's threads (``torch.set_num_threads``).

The kernel needs AVX-512: elsewhere the build fails with that message and torch's GEMM is used
(it would be faster than a portable build). Set ``RDSERVE_CPU_KERNELS=0`` to use torch's GEMM anyway.
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

SOURCE = Path(__file__).with_name("packed_gemm.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


class KernelUnavailable(RuntimeError):
    """The C kernels cannot be used here (disabled, no compiler, no AVX-512, or the build failed)."""


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC", "cc")) or ["cc"]
    path = shutil.which(cc[0])
    if path is None:
        raise KernelUnavailable(f"no C compiler {cc[0]!r} on PATH (set $CC, or RDSERVE_CPU_KERNELS=0)")
    return [path, *cc[1:]]


def _cpu_flags() -> str:
    """The host's instruction-set flags (``-march=native`` depends on them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def library_path() -> Path:
    """Where the library for this source, flags, compiler and CPU lives (built or not).

    Raises:
        KernelUnavailable: no C compiler.
    """
    cc = _compiler()
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, *cc, version, _cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"packed_gemm-{key}.so"


def _digest(path: Path | str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _intact(target: Path) -> bool:
    checksum = target.with_suffix(".sha256")
    try:
        return target.is_file() and checksum.read_text().strip() == _digest(target)
    except OSError:
        return False


def build() -> Path:
    """Compile the library unless an intact copy is already in the cache; returns its path.

    The build writes a temporary file, loads it once in a child process, fsyncs it and renames it
    into place, then writes its SHA-256; concurrent builders never expose a half-written file.

    Raises:
        KernelUnavailable: no compiler, the compiler failed (its message is included), or the
            result does not load.
    """
    target = library_path()
    if _intact(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([*_compiler(), *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120)
        if proc.returncode:
            raise KernelUnavailable(f"compiling {SOURCE.name} failed:\n{proc.stderr.strip()}")
        if os.path.getsize(tmp) == 0:
            raise KernelUnavailable(f"the compiler wrote an empty library for {SOURCE.name}")
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


def load() -> ctypes.CDLL:
    """The loaded kernel library (built on first use; a failure is remembered, not retried).

    Raises:
        KernelUnavailable: disabled with ``RDSERVE_CPU_KERNELS=0``, no AVX-512, or it cannot be built.
    """
    if os.environ.get("RDSERVE_CPU_KERNELS", "1").lower() in ("0", "off", "false", "no"):
        raise KernelUnavailable("disabled by RDSERVE_CPU_KERNELS")
    return library()


def library() -> ctypes.CDLL:
    """:func:`load` without the ``RDSERVE_CPU_KERNELS`` check: the cached handle, for hot paths
    whose module was built after :func:`load` succeeded.

    Raises:
        KernelUnavailable: it cannot be built or loaded.
    """
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
