"""MPI for this process, imported once with the settings tensor parallelism needs.

Import ``MPI`` from here, never from ``mpi4py`` directly, so that these settings precede
``MPI_Init``:

* ``mpi4py.rc.finalize = False``: the leader never calls ``MPI_Finalize``. A process can start
  several TP groups one after another (tests do), and after a rank died ``MPI_Finalize`` crashes
  (MPICH 5.0.2 segfaults in it). Ranks disconnect explicitly at shutdown.
* ``PATH``: MPICH's ``MPI_Comm_spawn`` from a singleton runs ``mpiexec`` (hydra) from ``PATH``. A Ray
  worker does not inherit a virtualenv's ``PATH``, so the interpreter's directory (where the PyPI
  ``mpich`` package puts ``mpiexec``) goes first. In front of it goes a directory whose
  ``mpiexec`` starts the real one in a new session (``setsid``): when a spawned rank dies, hydra
  kills the process group of the job, and without a new session that group is the leader's own
  (measured with MPICH 5.0.2: the leader, and pytest with it, died by SIGKILL); with it, the
  leader lives on and reports :class:`~workers.tp.comm.RankFailure`.
* ``UCX_TLS=^cma`` (unless set): MPICH's UCX netmod copies large intra-node messages (a few KiB
  and up) with cross-memory attach, and UCX aborts the process (SIGABRT in ``cma_ep.c``) when
  ``process_vm_readv`` finds the peer gone. Without CMA a rank that dies mid-transfer makes the
  leader raise :class:`~workers.tp.comm.RankFailure` instead of dying (measured with MPICH 5.0.2:
  5 of 6 kills during a 59-token TP2 forward aborted the leader with CMA, 0 of 8 without; TP2
  forward time unchanged within noise). A residue remains: in about 1 kill in 10 during a transfer
  MPICH's UCX progress engine segfaults inside ``MPI_Test`` (2 of 15 measured); the ch4:ofi netmod
  instead fails ``MPI_Test`` with an error that aborts even with ``ERRORS_RETURN`` on the group's
  communicators (tried). Either way the replica dies at once and Serve replaces it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import mpi4py


def _session_mpiexec_dir(real_mpiexec: str) -> str:
    """A temporary directory holding an ``mpiexec`` script that execs ``real_mpiexec`` after
    ``setsid()``."""
    d = tempfile.mkdtemp(prefix="rdserve-mpiexec-")
    atexit.register(shutil.rmtree, d, True)
    script = Path(d) / "mpiexec"
    script.write_text(
        "#!/bin/sh\n"
        f"exec '{sys.executable}' -c 'import os, sys; os.setsid(); os.execv(sys.argv[1], sys.argv[1:])' "
        f"'{real_mpiexec}' \"$@\"\n"
    )
    script.chmod(0o755)
    return d


def _prepare_path() -> None:
    path = [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    os.environ["PATH"] = os.pathsep.join(path)
    real = shutil.which("mpiexec")
    if real is not None:
        os.environ["PATH"] = os.pathsep.join([_session_mpiexec_dir(real), os.environ["PATH"]])


_prepare_path()
os.environ.setdefault("UCX_TLS", "^cma")  # inherited by spawned ranks through hydra
mpi4py.rc.finalize = False
from mpi4py import MPI  # noqa: E402  (after the settings above, on purpose)

__all__ = ["MPI"]
