"""Tiny random-weight Llama model and ReDrafter directories for structural tests.

Weights are random but seeded; the model uses the tiny byte-level tokenizer (``tiny_tokenizer``).
``scale`` sharpens the random logits so that greedy outputs repeat patterns a drafter can learn,
which makes multi-token acceptance frequent in tests.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from tiny_tokenizer import make_tiny_tokenizer
from workers.redrafter.drafter import DrafterConfig, ReDrafter


def make_tiny_model_dir(path: str | Path, seed: int = 0, *, layers: int = 2, hidden: int = 64,
                        heads: int = 4, kv_heads: int = 2, tie: bool = True, scale: float = 1.0) -> Path:
    """Save a random ``LlamaForCausalLM`` (Hugging Face format) plus tokenizer to ``path``.

    ``scale`` is the final RMSNorm weight, so it multiplies every logit.
    """
    path = Path(path)
    tok = make_tiny_tokenizer()
    cfg = HFLlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=tie, eos_token_id=[0, 2], bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = HFLlama(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
        model.model.norm.weight.fill_(scale)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(str(path))
    return path


def make_tiny_drafter_dir(model_dir: str | Path, path: str | Path, seed: int = 0, head_type: str = "shared") -> Path:
    """Save a random ReDrafter head shaped for the model in ``model_dir``."""
    from workers.models.loader import load_model

    base = load_model(model_dir)
    cfg = DrafterConfig(vocab_size=base.config.vocab_size, hidden_size=base.config.hidden_size,
                        num_draft_layers=2, head_type=head_type)
    torch.manual_seed(seed)
    drafter = ReDrafter(cfg, base.lm_head.weight.detach().clone())
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.1)
    drafter.save(path)
    return Path(path)


def make_trained_tiny_drafter_dir(model_dir: str | Path, path: str | Path, seed: int = 0, *,
                                  num_prompts: int = 256, response_len: int = 32, steps: int = 800) -> Path:
    """Train a ``shared`` ReDrafter head on the model's own greedy responses with the real
    self-distillation code (``distill_data.generate_dataset``, ``train.load_examples``,
    ``train.train_drafter``, the base model's distribution as target as for the committed
    drafter) and save it to ``path``.

    Prompts are random token ids (lengths 1..30, special ids 0-2 excluded); shards go to
    ``path/shards``.
    """
    import random

    from workers.models.loader import load_model
    from workers.training.distill_data import generate_dataset
    from workers.training.train import load_examples, train_drafter

    path = Path(path)
    base = load_model(model_dir)
    rng = random.Random(seed)
    vocab = base.config.vocab_size
    prompts = [{"prompt_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))]}
               for _ in range(num_prompts)]
    shards = path / "shards"
    generate_dataset(base, prompts, shards, response_len, batch_size=32, eos_ids=set(base.config.eos_token_id))
    examples = load_examples(shards, draft_len=4)
    train_drafter(base, examples, path, steps=steps, batch_size=64, lr=3e-3, checkpoint_every=10**9, seed=seed,
                  soft_weight=1.0)
    return path
