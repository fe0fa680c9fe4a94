"""Launching under ``mpiexec -n 4`` instead of spawning: rank 0 is the leader, the other ranks serve
it from inside the executor's constructor. The model has 2 KV heads, so TP4 replicates them (each
KV head on two ranks); hidden states and logits equal the unsharded model's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tiny_model import make_tiny_model_dir

REPO = Path(__file__).resolve().parents[3]

UNDER_MPIEXEC = """
import json, sys, torch
from workers.executor import LocalExecutor
from workers.forward_batch import contiguous_batch
from workers.models.loader import load_model
from workers.tp.executor import TPExecutor

ex = TPExecutor(sys.argv[1], 4, 64, num_threads=1)  # ranks 1..3 serve inside and exit
ref = LocalExecutor(load_model(sys.argv[1]), 64)
batch = contiguous_batch(torch.tensor([5, 9, 11, 200, 7, 64]), 0)
h, h_ref = ex.forward(batch), ref.forward(batch)
l, l_ref = ex.logits(h), ref.logits(h_ref)
print(json.dumps({"hidden": (h - h_ref).abs().max().item(), "logits": (l - l_ref).abs().max().item(),
                  "world": ex.comm.world_size, "kv_heads": ex.worker.model.model.layers[0].self_attn.n_kv}))
ex.close()
"""


def test_tp4_under_mpiexec_with_replicated_kv_heads(tmp_path):
    model = make_tiny_model_dir(tmp_path / "m", heads=4, kv_heads=2)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    proc = subprocess.run([str(mpiexec), "-n", "4", sys.executable, "-c", UNDER_MPIEXEC, str(model)],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["world"] == 4 and result["kv_heads"] == 1
    assert result["hidden"] < 3e-5 and result["logits"] < 3e-5
