"""The drafter on Q8_0 blocks (workers/redrafter/quantize.py): the blocks are gguf-py's, the layers
compute what the dequantized float32 layers compute, and a loaded drafter drafts from them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from workers.kernels.quant_linear import QuantLinear
from workers.redrafter.drafter import DrafterConfig, ReDrafter, load_drafter
from workers.redrafter.quantize import q8_0_linear, quantize_drafter_for_cpu


def test_q8_0_linear_computes_with_gguf_py_dequantized_weights():
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(70, 96, generator=gen), torch.randn(70, generator=gen)
    layer = q8_0_linear(w, b)
    want_w = torch.from_numpy(dequantize(quantize(w.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0))
    assert torch.equal(layer.weight, want_w)
    x = torch.randn(5, 96, generator=gen)
    torch.testing.assert_close(layer(x), x @ want_w.T + b, rtol=1e-5, atol=1e-5)
    assert (layer.weight - w).abs().max() <= w.abs().max() / 127  # half a step of the largest block scale, at most


def test_q8_0_requantizes_q8_0_rows_to_the_same_blocks():
    """Rows of a shared head taken from a Q8_0 LM head keep their blocks exactly."""
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)).numpy()
    blocks = quantize(w, GGMLQuantizationType.Q8_0)
    shipped = dequantize(blocks, GGMLQuantizationType.Q8_0)
    assert np.array_equal(quantize(shipped, GGMLQuantizationType.Q8_0), blocks)


def test_q8_0_linear_rejects_a_width_it_cannot_block():
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0_linear(torch.randn(4, 48))


@pytest.mark.parametrize("head_type", ["shared", "full"])
def test_quantized_drafter_logits_follow_float32(head_type):
    torch.manual_seed(0)
    vocab, hidden = 300, 64
    lm_head = torch.randn(vocab, hidden) * 0.2
    ref = ReDrafter(DrafterConfig(vocab, hidden, 2, head_type), lm_head if head_type == "shared" else None).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.1)
    ref.restrict_vocab(torch.arange(0, vocab, 3))
    q = ReDrafter(ref.config, lm_head if head_type == "shared" else None).eval()
    q.load_state_dict(ref.state_dict())
    q.restrict_vocab(torch.arange(0, vocab, 3))
    replaced = quantize_drafter_for_cpu(q)
    # rnn_u, rnn_w, 2 residual blocks, out_proj (shared) or the full head, and the draft-vocabulary head
    assert replaced == 6
    assert isinstance(q.lm_head[0].linear, QuantLinear) and isinstance(q._packed_head, QuantLinear)
    ctx, state = torch.randn(4, hidden), torch.randn(4, hidden)
    with torch.no_grad():
        want, got = ref.logits(ctx, state), q.logits(ctx, state)
        assert got.shape == want.shape == (4, 100)
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * want.abs().max().item())
        torch.testing.assert_close(q.step_state(state, ctx), ref.step_state(state, ctx), rtol=0.05, atol=0.02)


def test_load_drafter_q8_0(tiny_model_dirs, trained_drafter_dirs):
    from workers.models.loader import load_model

    model = load_model(str(tiny_model_dirs["tied_gqa2"]), torch.float32, "cpu")
    path = trained_drafter_dirs["tied_gqa2"]
    f32 = load_drafter(path, model.lm_head.weight)
    q8 = load_drafter(path, model.lm_head.weight, weight_format="Q8_0")
    assert isinstance(q8.rnn_u, QuantLinear) and not isinstance(f32.rnn_u, QuantLinear)
    h = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        a, b = f32.logits(h, torch.zeros_like(h)), q8.logits(h, torch.zeros_like(h))
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 2 / 3
    with pytest.raises(ValueError, match="weight_format"):
        load_drafter(path, model.lm_head.weight, weight_format="Q4_0")


@pytest.mark.parametrize("weight_format", ["float32", "Q8_0"])
def test_first_state_equals_a_step_from_the_zero_state(tiny_model_dirs, trained_drafter_dirs, weight_format):
    """The first draft step skips ``U s`` for ``s = 0`` (only U's bias is left); same state, every format."""
    from workers.models.loader import load_model
    from workers.redrafter.quantize import use_int8_activations_in_drafter

    model = load_model(str(tiny_model_dirs["tied_gqa2"]), torch.float32, "cpu")
    drafter = load_drafter(trained_drafter_dirs["tied_gqa2"], model.lm_head.weight, weight_format=weight_format)
    e = model.model.embed_tokens(torch.tensor([3, 17, 40]))
    with torch.no_grad():
        torch.testing.assert_close(drafter.first_state(e), drafter.step_state(torch.zeros_like(e), e))
        if weight_format == "Q8_0":
            use_int8_activations_in_drafter(drafter)
            torch.testing.assert_close(drafter.first_state(e), drafter.step_state(torch.zeros_like(e), e))
