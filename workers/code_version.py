"""The code version step costs belong to, beside the compute path (:mod:`workers.compute_path`).

A step's cost depends on the kernels, the model code and the engine loop as much as on the CPU: a
calibration recorded before a kernel changed can be several times off on the same machine. So
``rdserve calibrate`` records the version of the code it measured, and an engine trusts a
calibration's step times only when both its compute path and its code version are its own
(:mod:`workers.speculation.policy`).

The version is ``PACKAGE_VERSION+HASH``: the installed rdserve version and the first 12 hex digits
of a SHA-256 over the ``workers`` package's sources (``*.py``, ``*.c``, ``*.h``, by relative path).
Any edit to the engine's code gives another version, which errs on the side of measuring again
(a few seconds at start, :mod:`workers.speculation.startup`).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib import metadata
from pathlib import Path

SOURCES = ("*.py", "*.c", "*.h")


def sources_hash(root: Path) -> str:
    """First 12 hex digits of SHA-256 over every source file under ``root`` (relative path and
    content, in sorted order). An empty tree hashes too (to the digest of nothing)."""
    digest = hashlib.sha256()
    files = sorted({p for pattern in SOURCES for p in root.rglob(pattern) if p.is_file()})
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


@lru_cache(maxsize=1)
def code_version() -> str:
    """This process's code version, ``PACKAGE_VERSION+HASH`` (``0+HASH`` when rdserve is not installed
    as a package). Computed once per process."""
    try:
        version = metadata.version("rdserve")
    except metadata.PackageNotFoundError:
        version = "0"
    return f"{version}+{sources_hash(Path(__file__).resolve().parent)}"
