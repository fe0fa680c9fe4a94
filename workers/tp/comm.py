"""Communicator of one tensor-parallel group: collectives that fail fast when a rank dies.

Rank 0 is the leader (the engine replica); ranks ``1 .. world_size - 1`` only execute what the
leader broadcasts. Three operations serve the whole design:

* :meth:`Communicator.broadcast`: the leader's command (pickled) to every rank;
* :meth:`Communicator.all_reduce`: sum of a tensor over ranks, in place (after row-parallel
  layers and the vocabulary-parallel embedding);
* :meth:`Communicator.gather`: the leader concatenates every rank's vocabulary slice of the logits.

:class:`Communicator` moves tensors through MPI (CPU tensors as numpy buffers);
:class:`NcclCommunicator` moves them through NCCL (``torch.distributed`` initialised from the MPI
rank and size) and keeps MPI for control.

Fail fast: a blocking MPI collective with a dead peer never returns. Every MPI operation here is
non-blocking and waited for in a loop that checks, every :data:`LIVENESS_INTERVAL_S`, that the
group's processes (pids exchanged at start) are alive, and raises :class:`RankFailure` when one is
not. Pids are local, so the group must sit on one node (tensor parallelism does).
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from collections.abc import MutableMapping, Sequence
from pathlib import Path

import numpy as np
import torch

from workers.tp.mpi import MPI

LEADER = 0
LIVENESS_INTERVAL_S = 0.05
# How a rank waits (see Communicator.wait): busy-poll, then poll with sched_yield, then sleep.
SPIN_S, YIELD_S, SLEEP_S = 2e-4, 0.05, 1e-3
EXIT_SETTLE_S = 0.2  # after a dead peer is seen: time for other exits in progress to finish
HEADER_BYTES = 1 << 12  # first broadcast: 8-byte length + the command if it fits (decode: ~1 KiB)


class RankFailure(RuntimeError):
    """A process of the tensor-parallel group exited; the group cannot continue."""


_group_failed = False


def group_failed() -> bool:
    """True once a group of this process lost a rank. MPICH (5.0.2, measured) then crashes in
    ``MPI_Comm_spawn`` and ``MPI_Finalize``: the process must be restarted to start a new group."""
    return _group_failed


def process_alive(pid: int) -> bool:
    """False when ``pid`` does not exist or is a zombie (Linux ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def pin_rank_gpu(gpus: Sequence[str], rank: int, environ: MutableMapping[str, str] = os.environ) -> None:
    """Make ``gpus[rank]`` the only GPU this process sees (``CUDA_VISIBLE_DEVICES``; its device is then
    ``cuda:0``). Call before CUDA is initialised.

    Raises:
        IndexError: ``rank`` has no entry in ``gpus``.
    """
    if not 0 <= rank < len(gpus):
        raise IndexError(f"TP rank {rank} has no GPU in {list(gpus)}")
    environ["CUDA_VISIBLE_DEVICES"] = str(gpus[rank])


class Communicator:
    """Collectives of one TP group over an MPI intracommunicator (tensors through MPI, on CPU).

    Args:
        mpi_comm: intracommunicator whose rank 0 is the leader.
        link: the spawn intercommunicator ``mpi_comm`` was merged from, disconnected at shutdown.

    Every method is collective: all ranks call it in the same order (the leader decides the order
    and broadcasts it, see :mod:`workers.tp.rank_main`).
    """

    def __init__(self, mpi_comm: "MPI.Intracomm", link: "MPI.Intercomm | None" = None):
        self.mpi, self.link = mpi_comm, link
        self.rank = mpi_comm.Get_rank()
        self.world_size = mpi_comm.Get_size()
        self.pids: list[int] = mpi_comm.allgather(os.getpid())
        self._header = np.zeros(HEADER_BYTES, dtype=np.uint8)

    @property
    def is_leader(self) -> bool:
        return self.rank == LEADER

    def check_peers(self) -> None:
        """Raises:
            RankFailure: ``"TP rank r (pid p) exited"``, naming every dead process of the group
                (ranks that saw a peer die exit too, so more than the first may be listed).
        """
        if all(process_alive(pid) for r, pid in enumerate(self.pids) if r != self.rank):
            return
        # A rank killed by a signal closes its sockets before it becomes a zombie, and a sibling
        # that sees the reset may abort and be reaped first (seen in CI: a SIGKILLed rank 2 still
        # exiting while rank 3 was already gone). Let exits in progress finish so the message
        # names the rank that died first too.
        time.sleep(EXIT_SETTLE_S)
        dead = [f"TP rank {r} (pid {pid})" for r, pid in enumerate(self.pids)
                if r != self.rank and not process_alive(pid)]
        global _group_failed
        _group_failed = True
        raise RankFailure(f"{', '.join(dead)} exited")

    def wait(self, request: "MPI.Request") -> None:
        """Complete a non-blocking MPI request, checking peer liveness every
        :data:`LIVENESS_INTERVAL_S` while it is pending.

        Polls ``Test`` in a busy loop for :data:`SPIN_S` (collectives inside a forward), then with
        ``sched_yield`` until :data:`YIELD_S` (a peer that needs this core, e.g. TP8 on 2 cores),
        then sleeps :data:`SLEEP_S` between polls (an idle rank waiting for the next command).
        Measured on 2 cores: busy-polling for 2 ms instead made a TP2 iteration ~15x slower under
        background load, sleeping after 0.2 ms made a 16 KiB command broadcast cost ~0.7 ms.

        Raises:
            RankFailure: a process of the group died before the request completed.
        """
        start = time.monotonic()
        next_check = start + LIVENESS_INTERVAL_S
        while not request.Test():
            now = time.monotonic()
            if now >= next_check:
                self.check_peers()
                next_check = now + LIVENESS_INTERVAL_S
            waited = now - start
            if waited < SPIN_S:
                continue
            if waited < YIELD_S:
                os.sched_yield()  # free the core for a peer rank when ranks outnumber cores
            else:
                time.sleep(SLEEP_S)

    def broadcast(self, obj: object = None) -> object:
        """The leader's ``obj`` on every rank (pickled; one broadcast when it fits in
        :data:`HEADER_BYTES` - 8 bytes, two otherwise). Non-leaders pass nothing."""
        if self.world_size == 1:
            return obj
        header = self._header
        if self.is_leader:
            payload = pickle.dumps(obj, protocol=5)
            n = len(payload)
            header[:8] = np.frombuffer(n.to_bytes(8, "little"), dtype=np.uint8)
            head = min(n, HEADER_BYTES - 8)
            header[8 : 8 + head] = np.frombuffer(payload, dtype=np.uint8, count=head)
        self.wait(self.mpi.Ibcast(header, root=LEADER))
        n = int.from_bytes(header[:8].tobytes(), "little")
        if n <= HEADER_BYTES - 8:
            return obj if self.is_leader else pickle.loads(header[8 : 8 + n].tobytes())
        rest = np.empty(n - (HEADER_BYTES - 8), dtype=np.uint8)
        if self.is_leader:
            rest[:] = np.frombuffer(payload, dtype=np.uint8, offset=HEADER_BYTES - 8)
        self.wait(self.mpi.Ibcast(rest, root=LEADER))
        if self.is_leader:
            return obj
        return pickle.loads(header[8:].tobytes() + rest.tobytes())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks in place and return it (any shape; float16/bfloat16 are summed in
        float32)."""
        if self.world_size == 1:
            return x
        buf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        self.wait(self.mpi.Iallreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM))
        if buf is not x:
            x.copy_(buf)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate ``x: [M, n] float32`` (same shape on every rank) along the last dim, in rank
        order: ``[M, world_size * n]`` on the leader, ``None`` elsewhere."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        out = torch.empty(self.world_size, *x.shape, dtype=x.dtype) if self.is_leader else None
        self.wait(self.mpi.Igather(x.numpy(), None if out is None else out.numpy(), root=LEADER))
        if out is None:
            return None
        return out.permute(1, 0, 2).reshape(x.shape[0], -1)

    def synchronize(self) -> None:
        """Wait until this rank's queued collectives have completed (MPI ones complete inside the
        calls above)."""

    def disconnect(self) -> None:
        """Free the MPI communicator and disconnect the spawn link (healthy shutdown only: every
        rank calls it)."""
        self.mpi.Free()
        if self.link is not None:
            self.link.Disconnect()


class NcclCommunicator(Communicator):
    """Tensors through NCCL on CUDA (``torch.distributed``), control through MPI.

    Rank r uses GPU ``r % torch.cuda.device_count()``. The leader picks a free TCP port on
    127.0.0.1 for NCCL's rendezvous and broadcasts it over MPI (single node). Collectives are
    queued on the current CUDA stream; :meth:`synchronize` waits for them while checking peer
    liveness, so a dead rank raises :class:`RankFailure` there instead of hanging.
    """

    def __init__(self, mpi_comm: "MPI.Intracomm", link: "MPI.Intercomm | None" = None):
        import torch.distributed as dist

        super().__init__(mpi_comm, link)
        self.device = torch.device("cuda", self.rank % torch.cuda.device_count())
        torch.cuda.set_device(self.device)
        port = None
        if self.is_leader:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = self.broadcast(port)
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank, world_size=self.world_size,
            device_id=self.device,
        )
        self._dist = dist

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            self._dist.all_reduce(x)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_leader else None
        self._dist.gather(x, parts, dst=LEADER)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def synchronize(self) -> None:
        """Raises:
            RankFailure: a process of the group died while the queued work was pending.
        """
        event = torch.cuda.Event()
        event.record()
        next_check = time.monotonic()
        while not event.query():
            if time.monotonic() >= next_check:
                self.check_peers()
                next_check = time.monotonic() + LIVENESS_INTERVAL_S
            time.sleep(5e-5)  # a GPU wait: poll the event every 50 us

    def disconnect(self) -> None:
        self._dist.destroy_process_group()
        super().disconnect()


BACKENDS = {"mpi": Communicator, "nccl": NcclCommunicator}


def make_communicator(mpi_comm: "MPI.Intracomm", backend: str, link: "MPI.Intercomm | None" = None) -> Communicator:
    """``backend``: ``"mpi"`` (CPU tensors) or ``"nccl"`` (CUDA tensors). Collective.

    Raises:
        ValueError: unknown backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"TP backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    return BACKENDS[backend](mpi_comm, link)
