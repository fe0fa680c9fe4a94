"""CUDA path: tensors through NCCL, control through MPI (needs at least two GPUs)."""

from __future__ import annotations

import pytest
import torch

from tiny_model import make_tiny_model_dir
from workers.executor import LocalExecutor
from workers.forward_batch import contiguous_batch
from workers.models.loader import load_model

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a GPU (two, for NCCL TP2)")
def test_tp2_over_nccl_matches_unsharded(tmp_path):
    from workers.tp.executor import TPExecutor

    model = make_tiny_model_dir(tmp_path / "m", heads=4, kv_heads=2)
    ex = TPExecutor(str(model), 2, 64, device="cuda")
    try:
        ref = LocalExecutor(load_model(model, device="cuda"), 64)
        batch = contiguous_batch(torch.tensor([5, 9, 11, 200], device="cuda"), 0)
        h, h_ref = ex.forward(batch), ref.forward(batch)
        torch.testing.assert_close(h, h_ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(ex.logits(h), ref.logits(h_ref), atol=1e-4, rtol=0)
    finally:
        ex.close()
