"""Load a Hugging Face model directory (``config.json`` + ``*.safetensors``) into our decoder.

Hugging Face names map onto our parameters one to one, except that ``q_proj``/``k_proj``/``v_proj``
are concatenated into ``qkv_proj`` and ``gate_proj``/``up_proj`` into ``gate_up_proj``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from workers.models.config import LlamaConfig
from workers.models.llama import LlamaForCausalLM

_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def read_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of ``*.safetensors`` files in ``path``.

    Raises:
        FileNotFoundError: when the directory has no safetensors file.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def convert_hf_state_dict(hf: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Rename and fuse Hugging Face tensors into our parameter names."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf.items():
        if "rotary_emb" in name:
            continue
        fused = False
        for target, parts in _FUSED.items():
            if any(f".{p}." in name for p in parts[1:]):
                fused = True
            elif f".{parts[0]}." in name:
                siblings = [hf[name.replace(f".{parts[0]}.", f".{p}.")] for p in parts]
                out[name.replace(f".{parts[0]}.", f".{target}.")] = torch.cat(siblings, dim=0)
                fused = True
        if not fused:
            out[name] = tensor
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> LlamaForCausalLM:
    """Build :class:`LlamaForCausalLM` from a Hugging Face directory.

    Raises:
        FileNotFoundError: missing ``config.json`` or weights.
        ValueError: unsupported architecture, or weights that do not match the config.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json (expected a Hugging Face model directory)")
    cfg = LlamaConfig.from_dir(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    state = convert_hf_state_dict(read_hf_state_dict(path), cfg)
    missing, unexpected = _check_keys(model, state)
    if missing or unexpected:
        raise ValueError(f"weights in {path} do not match config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict(state, assign=True, strict=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary = type(model.model.rotary)(
        cfg.head_size, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
    )
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _check_keys(model: torch.nn.Module, state: dict) -> tuple[list[str], list[str]]:
    expected = set(model.state_dict().keys())
    if model.config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    return sorted(expected - state.keys()), sorted(state.keys() - expected)
