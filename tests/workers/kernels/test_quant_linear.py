"""The GGUF Q4_1 / Q8_0 kernels (workers/kernels/q4_1_gemm.c, q8_0_gemm.c): the panel layout against
gguf-py's own dequantization, bit-identity with the float32 kernel on the dequantized weights,
row independence, on each instruction-set build (``isa`` fixture)."""

from __future__ import annotations

import numpy as np
import pytest
from compute_paths import require_both_builds
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from workers.kernels import build
from workers.kernels.gguf_blocks import dequantize_panels, panels_from_blocks
from workers.kernels.packed_linear import PackedLinear
from workers.kernels.quant_linear import QuantLinear

FORMATS = ("Q4_1", "Q8_0")


def gguf_blocks(fmt: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """gguf-py's blocks of a random ``[n, k]`` matrix and its float32 dequantization."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) / k**0.5
    blocks = quantize(w, GGMLQuantizationType[fmt])
    return blocks, torch.from_numpy(dequantize(blocks, GGMLQuantizationType[fmt]).reshape(n, k))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(1, 32), (70, 64), (96, 576), (33, 1536)])
def test_panels_keep_every_value(fmt, n, k):
    blocks, want = gguf_blocks(fmt, n, k)
    panels = panels_from_blocks(fmt, blocks)
    per_block = {"Q4_1": 640, "Q8_0": 1088}[fmt]
    assert panels.shape == (-(-n // 32), k // 32, per_block) and panels.dtype == torch.uint8
    assert torch.equal(dequantize_panels(fmt, panels, n), want)
    bits = panels.numel() * 8 / (-(-n // 32) * 32 * k)
    assert bits == {"Q4_1": 5.0, "Q8_0": 8.5}[fmt]  # the file's bits per weight


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k,bias", [(70, 64, True), (960, 576, False), (100, 1536, True)])
def test_same_bits_as_the_float32_kernel_on_dequantized_weights(fmt, n, k, bias, isa):
    blocks, w = gguf_blocks(fmt, n, k, seed=n + k)
    b = torch.randn(n) if bias else None
    quant, packed = QuantLinear(fmt, blocks, k, b), PackedLinear(w, b)
    assert quant.isa == packed.isa == isa
    for m in (1, 2, 3, 5, 9, 10, 11, 18, 33):
        x = torch.randn(m, k)
        got = quant(x)
        assert got.shape == (m, n) and torch.equal(got, packed(x)), f"m={m}"
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert (got.double() - want).abs().max() < 1e-5 * max(1.0, k**0.5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_row_is_independent_of_the_others(fmt, isa):
    blocks, _ = gguf_blocks(fmt, 3 * 32 + 7, 576)
    lin = QuantLinear(fmt, blocks, 576)
    x = torch.randn(33, 576)
    together = lin(x)
    for i in range(33):
        assert torch.equal(lin(x[i : i + 1])[0], together[i])
    assert torch.equal(lin(x[4:21]), together[4:21])


@pytest.mark.parametrize("fmt", FORMATS)
def test_both_builds_compute_the_same_bits(fmt, monkeypatch):
    require_both_builds()
    blocks, _ = gguf_blocks(fmt, 200, 1536)
    x = torch.randn(19, 1536)
    outs = []
    for isa in ("avx512", "avx2"):
        monkeypatch.setenv("RDSERVE_CPU_ISA", isa)
        outs.append(QuantLinear(fmt, blocks, 1536)(x))
    assert torch.equal(outs[0], outs[1])


def test_weight_shapes_and_inputs_are_checked(isa):
    blocks, w = gguf_blocks("Q4_1", 40, 64)
    lin = QuantLinear("Q4_1", blocks, 64, tied_weight=w)
    assert lin.weight is w and lin(torch.randn(2, 3, 64)).shape == (2, 3, 40)
    assert lin(torch.randn(0, 64)).shape == (0, 40)
    assert torch.equal(lin.state_dict()["weight"], w)
    with pytest.raises(ValueError, match="float32 CPU input"):
        lin(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="unsupported weight format 'Q6_K'"):
        QuantLinear("Q6_K", blocks, 64)
    with pytest.raises(ValueError, match="divisible by 32"):
        QuantLinear("Q4_1", blocks, 48)
    with pytest.raises(ValueError, match="hold 64 columns, expected 96"):
        QuantLinear("Q4_1", blocks[:, :40], 96)
    with pytest.raises(ValueError, match="uint8"):
        panels_from_blocks("Q8_0", blocks)  # 40 bytes per row is not a whole number of Q8_0 blocks
