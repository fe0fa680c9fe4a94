"""Rank r of a spawned group is told its GPU (``gpus[r]``) and sees only that one (``CUDA_VISIBLE_DEVICES``).

The spawn is real (CPU ranks: the GPU list travels on the rank's command line and sets its
environment; on CPU nothing reads it). The CUDA run is ``tests/cluster/replica/test_placement.py``'s GPU test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.tp.comm import pin_rank_gpu
from workers.tp.launch import start_group


def test_pin_rank_gpu_sets_only_that_rank_gpu():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    pin_rank_gpu(["6", "2", "7"], 1, env)
    assert env == {"CUDA_VISIBLE_DEVICES": "2"}
    with pytest.raises(IndexError, match="rank 3"):
        pin_rank_gpu(["6", "2", "7"], 3, env)


def test_gpu_list_must_name_one_gpu_per_rank():
    with pytest.raises(ValueError, match="one GPU per rank"):
        start_group(2, "mpi", ["0", "1", "2"])


def test_spawned_rank_gets_its_gpu_list(tiny_model_dirs):
    from workers.tp.executor import TPExecutor

    ex = TPExecutor(str(tiny_model_dirs["tied_gqa2"]), 2, num_slots=8, num_threads=1, gpus=["5", "3"])
    try:
        argv = Path(f"/proc/{ex.comm.pids[1]}/cmdline").read_bytes().split(b"\0")
        assert argv[-3:-1] == [b"mpi", b"5,3"]  # rank_main BACKEND GPUS: rank 1 pins GPU "3"
    finally:
        ex.close()
