"""Tokenizer and chat template through transformers (``tokenizer.json`` + ``tokenizer_config.json``)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer stored beside the weights (no hub access)."""
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered with the model's chat template plus the generation prompt.

    Raises:
        ValueError: when the tokenizer has no chat template.
    """
    if not tokenizer.chat_template:
        raise ValueError("this model has no chat template; use /v1/completions with a plain prompt")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
