"""Parity of our Llama-family decoder with transformers' reference implementations (fp32).

Logits must agree (max abs difference < 1e-4) over ~300 positions, in one prefill and token by
token through the KV cache: on the tiny test models, a Qwen2-style model (q/k/v biases), a model with
``llama3`` RoPE scaling, and (slow) the default SmolLM2-135M-Instruct. Each with torch's linear
layers, with the packed CPU kernels, and with everything the engine runs in C on float32 CPU
(``prepare_cpu_inference``: packed linears, fused residual + RMSNorm, RoPE + KV write, decode
attention; a prefill of ~300 tokens keeps SDPA, decoding uses the attention kernel).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from workers.forward_batch import contiguous_batch
from workers.kernels import build
from workers.kernels.decode_attention import supports
from workers.kernels.packed_linear import pack_linears, prepare_cpu_inference
from workers.models.loader import load_model

TOL = 1e-4
NUM_POSITIONS = 300


def ours_prefill(model, ids: list[int]) -> torch.Tensor:
    """Logits ``[T, V]`` of one prefill."""
    cache = model.new_cache(len(ids))
    with torch.inference_mode():
        return model.logits(model(cache, contiguous_batch(torch.tensor(ids), 0)))


def ours_decode(model, ids: list[int]) -> torch.Tensor:
    """Logits ``[T, V]`` feeding one token per forward through the KV cache."""
    cache = model.new_cache(len(ids))
    rows = []
    with torch.inference_mode():
        for t, token in enumerate(ids):
            rows.append(model.logits(model(cache, contiguous_batch(torch.tensor([token]), t))[0]))
    return torch.stack(rows)


def reference_logits(model_dir: Path, hf_class, ids: list[int]) -> torch.Tensor:
    ref = hf_class.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0].float()


def assert_parity(model_dir: Path, hf_class, num_positions: int = NUM_POSITIONS, decode: bool = True) -> None:
    assert_parity_of(load_model(model_dir), model_dir, hf_class, num_positions, decode)
    if build.available():
        packed = load_model(model_dir)
        assert pack_linears(packed) > 0
        assert_parity_of(packed, model_dir, hf_class, num_positions, decode)
        native = load_model(model_dir)
        prepare_cpu_inference(native)
        attn = native.model.layers[0].self_attn
        assert (native.model.kernel_isa is not None) == supports(attn.head_dim, attn.n_heads, attn.n_kv)
        assert_parity_of(native, model_dir, hf_class, num_positions, decode)


def assert_parity_of(ours, model_dir: Path, hf_class, num_positions: int, decode: bool) -> None:
    vocab = ours.config.vocab_size
    ids = torch.randint(3, vocab, (num_positions,), generator=torch.Generator().manual_seed(0)).tolist()
    want = reference_logits(model_dir, hf_class, ids)
    assert want.std() > 0.1, "logits too flat for a meaningful comparison"
    got = ours_prefill(ours, ids)
    assert (got - want).abs().max() < TOL
    if decode:
        assert (ours_decode(ours, ids) - want).abs().max() < TOL


def randomize_and_save(model: torch.nn.Module, path: Path, seed: int) -> Path:
    from tiny_tokenizer import make_tiny_tokenizer

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.08)
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(str(path))
    return path


@pytest.mark.parametrize("variant", ["tied_gqa2", "untied_mqa"])
def test_parity_with_transformers_llama(tiny_model_dirs, variant):
    assert_parity(tiny_model_dirs[variant], transformers.LlamaForCausalLM)


@pytest.mark.skipif(not hasattr(transformers, "Qwen2ForCausalLM"), reason="transformers has no Qwen2")
def test_parity_with_transformers_qwen2(tmp_path):
    cfg = transformers.Qwen2Config(
        vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, use_sliding_window=False,
    )
    model = transformers.Qwen2ForCausalLM(cfg).float()
    assert any(".q_proj.bias" in n for n, _ in model.named_parameters())
    assert_parity(randomize_and_save(model, tmp_path / "qwen2", seed=3), transformers.Qwen2ForCausalLM)


def test_parity_with_llama3_rope_scaling(tmp_path):
    """Original context 64 < 300 positions, so low, medium and high frequency bands all matter."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    cfg = transformers.LlamaConfig(
        vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rope_theta=500000.0, rope_scaling=scaling,
    )
    model = transformers.LlamaForCausalLM(cfg).float()
    path = randomize_and_save(model, tmp_path / "llama3", seed=4)
    from workers.models.config import LlamaConfig

    parsed = LlamaConfig.from_dir(path)
    assert parsed.rope_scaling and parsed.rope_scaling.get("rope_type") == "llama3"
    assert_parity(path, transformers.LlamaForCausalLM)


@pytest.mark.slow
def test_parity_on_default_model():
    from workers.models.pull import pull_default

    assert_parity(pull_default(), transformers.LlamaForCausalLM, num_positions=256, decode=False)
