"""Turn a tiny Hugging Face model directory into a GGUF-shipped one, as ``rdserve model pull`` leaves
the default model: ``model.gguf`` (linear layers Q4_1, embeddings / LM head Q8_0, norms F32, rows
of attn_q/attn_k permuted as llama.cpp's converter does) next to ``model.safetensors`` rewritten
with the dequantized values. Quantization and dequantization are gguf-py's, not ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

GGUF_SUFFIX = "@gguf"  # tiny_model_dirs["<variant>@gguf"]: the variant shipped as GGUF (tests/conftest.py)
_LINEARS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face -> GGUF row order of attn_q/attn_k (rotary halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_tiny_gguf(model_dir: str | Path, layer_type: str = "Q4_1", head_type: str = "Q8_0",
                   overrides: dict[str, str] | None = None) -> Path:
    """Write ``model_dir/model.gguf`` and dequantize ``model.safetensors`` in place; returns the GGUF path.

    ``overrides``: GGUF tensor name -> ggml type name for single tensors (e.g. an unsupported one).
    """
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    state = load_file(str(model_dir / "model.safetensors"))
    overrides = overrides or {}
    writer = GGUFWriter(str(model_dir / "model.gguf"), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])

    def put(gguf_name: str, hf_name: str, qtype: str, n_head: int | None = None):
        w = state[hf_name].float().numpy()
        qtype = overrides.get(gguf_name, qtype)
        kind = GGMLQuantizationType[qtype]
        if qtype == "F32":
            data, back = w, w
        else:
            data = quantize(w, kind)
            back = dequantize(data, kind).reshape(w.shape)
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(back))
        if n_head:
            data = llama_cpp_permute(data, n_head)
        writer.add_tensor(gguf_name, data, raw_dtype=None if qtype == "F32" else kind)

    put("token_embd.weight", "model.embed_tokens.weight", head_type)
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in _LINEARS.items():
            heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}.get(gg)
            put(f"blk.{i}.{gg}.weight", f"model.layers.{i}.{hf}.weight", layer_type, heads)
        put(f"blk.{i}.attn_norm.weight", f"model.layers.{i}.input_layernorm.weight", "F32")
        put(f"blk.{i}.ffn_norm.weight", f"model.layers.{i}.post_attention_layernorm.weight", "F32")
    put("output_norm.weight", "model.norm.weight", "F32")
    if "lm_head.weight" in state and not cfg.get("tie_word_embeddings"):
        put("output.weight", "lm_head.weight", head_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return model_dir / "model.gguf"


def weights_variant(variant: str, weights: str) -> str:
    """The ``tiny_model_dirs`` key of ``variant`` served with ``weights`` ``"float32"`` or ``"gguf"``."""
    return variant + GGUF_SUFFIX if weights == "gguf" else variant
