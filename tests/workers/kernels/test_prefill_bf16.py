"""Prompt rows on oneDNN's bfloat16 GEMM (workers/kernels/prefill_bf16.py): every row's result is
independent of the chunk and its neighbours, close to float32, and QuantLinear keeps every other row
on its float32 kernel bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from workers.kernels import build
from workers.kernels.prefill_bf16 import BLOCK_ROWS, amx_bf16_available, prefill_linear, resolve_prefill_dtype
from workers.kernels.quant_linear import QuantLinear

# model-like shapes (the default model's fused QKV, O, gate+up, down) and tiny ones (test models)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (96, 64), (48, 32)]
SLICES = [(0, 1), (0, 2), (0, 5), (0, 17), (3, 40), (0, BLOCK_ROWS), (1, BLOCK_ROWS + 1), (10, 300), (0, 512), (7, 700)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_each_row_is_independent_of_the_chunk_it_is_in(n, k):
    """A prompt's values must not depend on how the scheduler chunks or batches it: oneDNN picks
    its blocking from the row count, so fixed blocks of BLOCK_ROWS rows are what makes this hold."""
    torch.manual_seed(n + k)
    w = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(700, k)
    full = prefill_linear(x, w)
    for a, b in SLICES:
        assert torch.equal(prefill_linear(x[a:b], w), full[a:b]), f"rows {a}:{b}"
    shuffled = torch.randperm(700)[:123]
    assert torch.equal(prefill_linear(x[shuffled], w), full[shuffled])


@pytest.mark.parametrize("n,k", SHAPES[:4])
def test_close_to_float32(n, k):
    torch.manual_seed(1)
    w = torch.randn(n, k) / k**0.5
    bias = torch.randn(n)
    x = torch.randn(130, k)
    got = prefill_linear(x, w.to(torch.bfloat16), bias)
    want = torch.nn.functional.linear(x.double(), w.double(), bias.double())
    assert got.dtype == torch.float32 and got.shape == (130, n)
    # bfloat16 rounding of weights, activations and outputs: ~2^-8 relative per value
    assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max()


def _quant_linear(n: int, k: int, bias: bool = True) -> QuantLinear:
    w = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32) / k**0.5
    return QuantLinear("Q4_1", quantize(w, GGMLQuantizationType.Q4_1), k, torch.randn(n) if bias else None)


@pytest.mark.skipif(not build.available(), reason="CPU kernels unavailable here (no C compiler or no AVX2, "
                    "or RDSERVE_CPU_KERNELS=0)")
@pytest.mark.parametrize("rows", ["leading", "indices"])
def test_quant_linear_sends_only_prompt_rows_to_bfloat16(rows):
    lin = _quant_linear(160, 576)
    x = torch.randn(40, 576)
    plain = lin(x)  # float32 kernel, every row
    lin.enable_bf16_prefill()
    assert lin.prefill_weight.dtype == torch.bfloat16
    assert torch.equal(lin(x), plain), "without prompt rows the float32 kernel runs"
    prompt = torch.arange(25) if rows == "leading" else torch.tensor([0, 1, 2, 7, 8, 30, 31, 39])
    got = lin(x, 25 if rows == "leading" else prompt)
    others = torch.ones(40, dtype=torch.bool)
    others[prompt] = False
    assert torch.equal(got[others], plain[others]), "decode/tree rows stay bit-identical to float32"
    assert torch.equal(got[prompt], prefill_linear(x[prompt], lin.prefill_weight, lin.bias))
    assert not torch.equal(got[prompt], plain[prompt])  # they did take the bfloat16 path
    assert (got[prompt] - plain[prompt]).abs().max() <= 2e-2 * plain.abs().max()
    assert torch.equal(lin(x, 40), prefill_linear(x, lin.prefill_weight, lin.bias))


def test_resolve_prefill_dtype():
    assert resolve_prefill_dtype("auto") == ("bfloat16" if amx_bf16_available() else "float32")
    assert resolve_prefill_dtype("float32") == "float32"
    assert resolve_prefill_dtype("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="prefill_dtype must be one of auto, float32, bfloat16"):
        resolve_prefill_dtype("fp8")


@pytest.mark.parametrize("n,k", SHAPES)
def test_same_bits_whatever_the_thread_count(n, k):
    """Engines with different thread counts (cores / replicas) give the same prompt values, as the
    float32 kernels do: oneDNN's partition changes from 8 threads up, so prefill caps its threads."""
    torch.manual_seed(k - n)
    w = torch.randn(n, k).to(torch.bfloat16)
    x = torch.randn(150, k)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 4, 8, 16):
            torch.set_num_threads(threads)
            results.append(prefill_linear(x, w))
            assert torch.get_num_threads() == threads  # restored
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results[1:])
