"""Weight buffers on huge-page-advised memory (workers/kernels/hugepages.py)."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch

from workers.kernels import hugepages


@pytest.mark.skipif(not hugepages.enabled(), reason="no MADV_HUGEPAGE here, or RDSERVE_HUGEPAGES=0")
def test_tensors_are_carved_from_arenas_and_outlive_them():
    small = [hugepages.empty((300, 1000), torch.float32) for _ in range(60)]  # 1.2 MB each: > 1 arena
    big = hugepages.empty((20, 1 << 20), torch.float32)  # 80 MB: its own mapping
    for i, t in enumerate(small):
        t.fill_(i)
    big.fill_(-1.0)
    hugepages._arena[0] = None  # drop the module's reference to the current arena
    gc.collect()
    assert all(t.shape == (300, 1000) and t.is_contiguous() and t.data_ptr() % 64 == 0 for t in small)
    assert all(float(t[-1, -1]) == i for i, t in enumerate(small))
    assert float(big.sum()) == -20 * (1 << 20)
    assert torch.equal(pickle.loads(pickle.dumps(small[3])), small[3])


def test_small_tensors_and_the_switch_use_plain_memory(monkeypatch):
    assert hugepages.empty((4, 4), torch.float32).shape == (4, 4)
    monkeypatch.setenv("RDSERVE_HUGEPAGES", "0")
    assert not hugepages.enabled()
    t = hugepages.empty((1000, 1000), torch.uint8)
    assert t.shape == (1000, 1000) and t.dtype == torch.uint8
