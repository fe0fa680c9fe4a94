"""Tokenizer and chat template through transformers (``tokenizer.json`` + ``tokenizer_config.json``)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from workers.models.tool_prompt import render_generic, template_takes_tools


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer stored beside the weights (no hub access)."""
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                        tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered with the model's chat template plus the generation prompt.

    ``tools`` (OpenAI's list of function tools) and tool calls / results in ``messages`` go to a
    template that renders tools itself; other templates get them in the generic format of
    :mod:`workers.models.tool_prompt`.

    Raises:
        ValueError: when the tokenizer has no chat template, or a tool call is malformed.
    """
    if not tokenizer.chat_template:
        raise ValueError("this model has no chat template; use /v1/completions with a plain prompt")
    uses_tools = tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if uses_tools and template_takes_tools(tokenizer.chat_template):
        ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True)
    else:
        if uses_tools:
            messages = render_generic(messages, tools)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
