"""A TP replica fails fast: a killed rank makes the leader's next call raise RankFailure within
seconds, and a killed leader makes its ranks exit.

Each scenario runs in its own leader process (MPICH cannot start another group in a process that
lost a rank, see :func:`workers.tp.comm.group_failed`); the kills are real SIGKILLs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny_model import make_tiny_model_dir
from workers.tp.comm import process_alive

REPO = Path(__file__).resolve().parents[3]

RANK_KILLED = """
import json, os, sys, time, torch
from workers.forward_batch import contiguous_batch
from workers.tp.comm import RankFailure, process_alive
from workers.tp.executor import TPExecutor

ex = TPExecutor(sys.argv[1], 4, 64, num_threads=1)
batch = contiguous_batch(torch.tensor([5, 9, 11]), 0)
ex.logits(ex.forward(batch))
victim = ex.comm.pids[2]
os.kill(victim, 9)
errors, t0 = [], time.monotonic()
for call in (lambda: ex.forward(batch), lambda: ex.logits(torch.zeros(1, 64))):
    try:
        call()
    except RankFailure as e:
        errors.append(str(e))
raise_s = time.monotonic() - t0
ex.close()
deadline = time.monotonic() + 10
while time.monotonic() < deadline and any(process_alive(p) for p in ex.comm.pids[1:]):
    time.sleep(0.1)
try:
    TPExecutor(sys.argv[1], 2, 64)
    restart = "started"
except RuntimeError as e:
    restart = str(e)
print(json.dumps({"victim": victim, "errors": errors, "raise_s": raise_s, "restart": restart,
                  "survivors": [p for p in ex.comm.pids[1:] if process_alive(p)]}))
"""

KILLED_MID_TRANSFER = """
import os, sys, threading, torch
from workers.forward_batch import contiguous_batch
from workers.tp.comm import RankFailure
from workers.tp.executor import TPExecutor

ex = TPExecutor(sys.argv[1], 2, 256, num_threads=1)
batch = contiguous_batch(torch.arange(1, 120), 0)  # 119 tokens: all-reduces of ~30 KiB
ex.logits(ex.forward(batch))
threading.Timer(0.3, os.kill, (ex.comm.pids[1], 9)).start()
try:
    while True:
        ex.logits(ex.forward(batch))
except RankFailure as e:
    print("RankFailure:", e)
"""

LEADER_KILLED = """
import sys, time
from workers.tp.executor import TPExecutor

ex = TPExecutor(sys.argv[1], 2, 64, num_threads=1)
print(ex.comm.pids[1], flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tp_failure") / "m", heads=4, kv_heads=2)


def _leader(script: str, model_dir: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, str(model_dir)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, **kw)


def test_killed_rank_raises_rank_failure(model_dir):
    proc = _leader(RANK_KILLED, model_dir)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert len(result["errors"]) == 2  # the call after the kill, and every later call
    # hydra ends the victim's siblings, so more ranks than the victim may be named
    assert f"TP rank 2 (pid {result['victim']})" in result["errors"][0]
    assert result["errors"][0].endswith("exited") and result["errors"][1] == result["errors"][0]
    assert result["raise_s"] < 5
    assert result["survivors"] == []  # close() ended the ranks that were still alive
    assert "restart the process" in result["restart"]


@pytest.mark.parametrize("attempt", range(3))
def test_rank_killed_during_a_large_transfer_raises_rank_failure_not_abort(model_dir, attempt):
    """Regression: with UCX's CMA transport the leader died by SIGABRT in 5 of 6 such kills
    (``process_vm_readv`` in ``cma_ep.c``; see workers/tp/mpi.py). Without CMA the leader raises
    RankFailure, except in about 1 kill in 10, where MPICH 5.0.2's UCX progress engine segfaults inside
    ``MPI_Test`` (measured 2 of 15; no error handler can catch it). That residue is known and tolerated
    here (Serve replaces the replica either way); an abort by CMA, or a hang, fails the test."""
    proc = _leader(KILLED_MID_TRANSFER, model_dir, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert "cma_ep.c" not in err and "process_vm_readv" not in err, err[-2000:]
    if proc.returncode == -signal.SIGSEGV:
        return  # the known MPICH/UCX residue (see above)
    assert proc.returncode == 0, err[-2000:]
    assert "RankFailure: TP rank 1" in out, (out, err[-2000:])


def test_killed_leader_makes_ranks_exit(model_dir):
    proc = _leader(LEADER_KILLED, model_dir)
    try:
        rank_pid = int(proc.stdout.readline())
        assert process_alive(rank_pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and process_alive(rank_pid):
            time.sleep(0.1)
        assert not process_alive(rank_pid)
    finally:
        proc.kill()
        proc.wait()
