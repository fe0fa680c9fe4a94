"""Start a tensor-parallel group: the leader (this process, rank 0) and ``tp_size - 1`` ranks.

Two ways, chosen by how this process was started:

* alone (a Ray actor, a test, a script): ``MPI.COMM_SELF.Spawn`` starts ``python -m
  workers.tp.rank_main`` ``tp_size - 1`` times through MPICH's hydra (``PATH`` is prepared in
  :mod:`workers.tp.mpi`); the spawn intercommunicator is merged into one intracommunicator with
  the leader as rank 0;
* under ``mpiexec -n tp_size`` (when spawning is unavailable, e.g. OpenMPI as root, see
  ``workers/tp/README.md``): ``COMM_WORLD`` is the group; rank 0 returns as the leader, every other
  rank serves the leader's commands in :func:`workers.tp.rank_main.serve` and then exits the
  process, so the code after the executor's construction runs on rank 0 only. Every process calls
  ``MPI_Finalize`` at its exit (the leader through ``atexit``).
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Sequence

from workers.tp.comm import LEADER, Communicator, group_failed, make_communicator
from workers.tp.mpi import MPI


def start_group(tp_size: int, backend: str, gpus: Sequence[str] | None = None) -> Communicator:
    """The leader's communicator of a new group of ``tp_size`` ranks.

    ``gpus``: spawned rank r (r >= 1) sees only GPU ``gpus[r]`` (:func:`~workers.tp.comm.pin_rank_gpu`); ``gpus[0]`` is
    the leader's, already set by whoever started it (Ray). None: rank r uses GPU ``r % count`` of
    what it sees (also under ``mpiexec``, where ``gpus`` is not used).

    Raises:
        ValueError: running under ``mpiexec`` with a world size other than ``tp_size``; ``gpus`` not
            ``tp_size`` long.
        RuntimeError: ``MPI_Comm_spawn`` failed, or an earlier group of this process lost a rank
            (:func:`~workers.tp.comm.group_failed`; restart the process).
    """
    if gpus is not None and len(gpus) != tp_size:
        raise ValueError(f"gpus {list(gpus)} must name one GPU per rank (tp_size={tp_size})")
    if group_failed():
        raise RuntimeError("a TP rank of an earlier group in this process died; MPI cannot start "
                           "another group here: restart the process")
    world = MPI.COMM_WORLD
    if world.Get_size() > 1:
        if world.Get_size() != tp_size:
            raise ValueError(f"started under mpiexec with {world.Get_size()} processes but tp_size={tp_size}")
        comm = make_communicator(world.Dup(), backend)
        if comm.rank != LEADER:
            from workers.tp.rank_main import serve

            serve(comm)
            MPI.Finalize()
            sys.exit(0)
        atexit.register(_finalize_world)
        return comm
    if tp_size == 1:
        return make_communicator(MPI.COMM_SELF.Dup(), backend)
    try:
        args = ["-m", "workers.tp.rank_main", backend] + ([",".join(map(str, gpus))] if gpus else [])
        link = MPI.COMM_SELF.Spawn(sys.executable, args, maxprocs=tp_size - 1)
    except MPI.Exception as e:
        raise RuntimeError(
            f"could not start {tp_size - 1} TP ranks with MPI_Comm_spawn ({e}); "
            "run the replica under `mpiexec -n tp_size` instead"
        ) from e
    return make_communicator(link.Merge(high=False), backend, link)


def _finalize_world() -> None:
    """At the leader's exit under ``mpiexec``: ``MPI_Finalize`` pairs with the ranks' (hydra
    treats a process that exits without it as failed and kills the job), unless a rank died
    (MPICH then crashes in it)."""
    if not group_failed() and not MPI.Is_finalized():
        MPI.Finalize()
