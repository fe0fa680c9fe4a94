"""Shared test setup: make helpers in tests/ (e.g. ``tiny_tokenizer``) importable from any test."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars from the training code in test logs

import pytest
import torch

# Tiny models are far faster on one thread than on two contended ones.
torch.set_num_threads(1)

# Tiny model variants: tied embeddings with 2 query heads per KV head, and untied embeddings with one
# KV head (multi-query attention), 3 layers and sharper logits (more varied greedy text).
TINY_VARIANTS = {
    "tied_gqa2": dict(seed=0, tie=True, kv_heads=2),
    "untied_mqa": dict(seed=1, tie=False, kv_heads=1, layers=3, scale=4.0),
}


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """``{variant: model dir}`` for every entry of ``TINY_VARIANTS``, built once per session."""
    from tiny_model import make_tiny_model_dir

    root = tmp_path_factory.mktemp("tiny_models")
    return {name: make_tiny_model_dir(root / name, **kw) for name, kw in TINY_VARIANTS.items()}


@pytest.fixture(scope="session")
def trained_drafter_dirs(tiny_model_dirs, tmp_path_factory):
    """``{variant: drafter dir}``: a ``shared`` drafter self-distilled on each tiny model."""
    from tiny_model import make_trained_tiny_drafter_dir

    root = tmp_path_factory.mktemp("tiny_drafters")
    return {name: make_trained_tiny_drafter_dir(path, root / name) for name, path in tiny_model_dirs.items()}
