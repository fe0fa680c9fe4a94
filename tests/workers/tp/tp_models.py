"""Tiny random-weight models for the tensor-parallel tests.

``make_tp_model_dir`` trims the vocabulary to ``vocab`` ids (397 is prime), so every ``tp_size``
pads its last vocabulary slice and the padded embedding/LM-head path is exercised.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from tiny_model import make_tiny_model_dir


def make_tp_model_dir(path: Path, *, heads: int, kv_heads: int, vocab: int = 397, layers: int = 2,
                      hidden: int = 64, seed: int = 0) -> Path:
    make_tiny_model_dir(path, seed, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, scale=3.0)
    weights = path / "model.safetensors"
    state = load_file(str(weights))
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][:vocab].contiguous()
    save_file(state, str(weights), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["vocab_size"] = vocab
    (path / "config.json").write_text(json.dumps(cfg))
    return path
