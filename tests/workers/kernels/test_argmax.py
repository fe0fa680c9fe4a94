"""Greedy decoding's C argmax (workers/kernels/argmax.py) against torch's ``max(dim=-1).indices``, on
each instruction-set build (``isa`` fixture): ties, NaN, infinities, widths that are not a multiple
of the vector length."""

from __future__ import annotations

import pytest
import torch

from workers.kernels.argmax import argmax_rows
from workers import sampling
from workers.sampling import greedy_tokens


def cases(rows: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    ties = x.clone()
    ties[:, ::3] = ties.max()  # the maximum at every third column: the first one wins
    rounded = (x * 2).round()  # many equal values
    nan = x.clone()
    nan[0, n // 2] = float("nan")
    nan[-1, n - 1] = float("nan")
    nan[-1, max(0, n - 5)] = float("nan")  # two NaNs in a row: the first one
    inf = x.clone()
    inf[:, -1] = float("inf")
    neg = torch.full((rows, n), float("-inf"))  # all -inf: index 0
    mixed = torch.full((rows, n), float("-inf"))
    mixed[:, n - 1] = -1e30
    zeros = torch.full((rows, n), -1.0)  # -0.0 and 0.0 compare equal: the first of either wins
    zeros[:, n // 3] = -0.0
    zeros[:, n - 1] = 0.0
    tiny = torch.full((rows, n), -1.0)  # denormals are numbers, not zero (no flush to zero)
    tiny[:, 0] = 0.0
    tiny[:, n - 1] = 1e-40
    return [x, ties, rounded, nan, inf, neg, mixed, zeros, tiny]


@pytest.mark.parametrize("rows,n", [(1, 49152), (16, 49152), (3, 7), (5, 16), (2, 17), (4, 33), (1, 1)])
def test_same_indices_as_torch_max(rows, n, isa):
    for i, x in enumerate(cases(rows, n, rows * 100 + n)):
        assert torch.equal(argmax_rows(isa, x), x.max(dim=-1).indices), f"case {i}"


def test_greedy_tokens_takes_the_kernel_and_falls_back_for_other_tensors(monkeypatch):
    x = torch.randn(4, 1000)
    assert torch.equal(greedy_tokens(x), x.argmax(dim=-1))
    calls = []
    monkeypatch.setattr(sampling, "argmax_rows", lambda isa, t: calls.append(isa) or t.max(dim=-1).indices)
    greedy_tokens(x)
    assert calls, "float32 CPU logits should take the C kernel"
    greedy_tokens(x.double())
    assert len(calls) == 1, "float64 logits go to torch"
    assert torch.equal(greedy_tokens(x.t().contiguous().t()), x.argmax(dim=-1))  # not contiguous: torch
    assert torch.equal(greedy_tokens(x.double()), x.argmax(dim=-1))  # float64: torch


def test_refuses_what_it_cannot_read(isa):
    with pytest.raises(ValueError, match="contiguous"):
        argmax_rows(isa, torch.randn(3, 5).t())
    with pytest.raises(ValueError, match="float32"):
        argmax_rows(isa, torch.randn(3, 5).double())
    with pytest.raises(ValueError, match="V>0"):
        argmax_rows(isa, torch.randn(3, 0))
