"""A non-leader rank: execute the leader's commands until it says ``shutdown``.

Ranks never decide anything: every forward, logits, KV-copy and shutdown comes from the leader's
broadcast (:mod:`workers.tp.wire`), so all ranks run the same collectives in the same order.
A rank that fails (an exception, or a peer that died) exits with status 1; the leader then raises
:class:`~workers.tp.comm.RankFailure` at its next wait.

Entry point of spawned ranks: ``python -m workers.tp.rank_main BACKEND [GPU0,GPU1,...]``; with the
GPU list, rank r sees only GPU r of it (:func:`workers.tp.comm.pin_rank_gpu`).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

from workers.models.loader import load_model
from workers.tp.comm import Communicator, RankFailure, make_communicator, pin_rank_gpu
from workers.tp.mpi import MPI
from workers.tp.wire import OPS, unpack
from workers.tp.worker import ShardWorker


def serve(comm: Communicator) -> None:
    """Run commands until ``shutdown``, then disconnect.

    Raises:
        ValueError: an unknown command; otherwise what a command raises.
    """
    device = getattr(comm, "device", torch.device("cpu"))
    worker = None
    while True:
        op, args = unpack(comm.broadcast(), device)
        if op not in OPS:
            raise ValueError(f"unknown TP command {op!r}")
        if op == "init":
            if args["num_threads"]:
                torch.set_num_threads(args["num_threads"])
            model = load_model(args["model_path"], getattr(torch, args["dtype"]), str(device))
            kv_dtype = getattr(torch, args["kv_dtype"]) if args.get("kv_dtype") else None
            worker = ShardWorker(model, args["num_slots"], comm, kv_dtype)
        elif op == "shutdown":
            comm.disconnect()
            return
        else:
            getattr(worker, op)(*args)


def main() -> None:
    parent = MPI.Comm.Get_parent()
    try:
        group = parent.Merge(high=True)
        if len(sys.argv) > 2:  # before make_communicator, which initialises CUDA for "nccl"
            pin_rank_gpu(sys.argv[2].split(","), group.Get_rank())
        serve(make_communicator(group, sys.argv[1], parent))
    except RankFailure as e:
        print(f"rdserve TP rank (pid {os.getpid()}): {e}; exiting", file=sys.stderr, flush=True)
        os._exit(1)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    MPI.Finalize()


if __name__ == "__main__":
    main()
