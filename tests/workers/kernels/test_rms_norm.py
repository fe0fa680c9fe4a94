"""The fused residual add + RMSNorm kernel (workers/kernels/rms_norm.py) against torch's RMSNorm,
on each instruction-set build (``isa`` fixture)."""

from __future__ import annotations

import pytest
import torch

from workers.kernels import build
from workers.kernels.rms_norm import rms_norm
from workers.models.llama import RMSNorm


@pytest.mark.parametrize("rows,n", [(1, 576), (3, 64), (40, 576), (2, 37), (5, 16), (1, 7)])
@pytest.mark.parametrize("fused", [False, True])
def test_matches_torch_rmsnorm(rows, n, fused, isa):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    norm = RMSNorm(n, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=g))
    x = torch.randn(rows, n, generator=g) * 3
    delta = torch.randn(rows, n, generator=g) if fused else None
    want_x = x + delta if fused else x.clone()
    xd = want_x.double()
    want = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.detach().double()).float()
    got = rms_norm(isa, x, norm.weight.detach(), 1e-5, delta)
    assert torch.equal(x, want_x)  # the residual add rounds as torch's does, in place
    assert (got - want).abs().max() < 2e-6 * max(1.0, want.abs().max().item())


def test_rows_are_independent_and_builds_agree(isa):
    x, w = torch.randn(17, 576), torch.randn(576)
    together = rms_norm(isa, x.clone(), w, 1e-6)
    for i in (0, 5, 16):
        assert torch.equal(rms_norm(isa, x[i : i + 1].clone(), w, 1e-6)[0], together[i])
    if build.supported_isas() == ["avx512", "avx2"]:
        other = "avx2" if isa == "avx512" else "avx512"
        assert torch.equal(rms_norm(other, x.clone(), w, 1e-6), together)


def test_bad_input_is_refused(isa):
    w = torch.ones(8)
    with pytest.raises(ValueError, match="float32 CPU x"):
        rms_norm(isa, torch.ones(2, 8, dtype=torch.float64), w, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(isa, torch.ones(2, 8), torch.ones(9), 1e-6)
    with pytest.raises(ValueError, match="delta"):
        rms_norm(isa, torch.ones(2, 8), w, 1e-6, torch.ones(3, 8))
