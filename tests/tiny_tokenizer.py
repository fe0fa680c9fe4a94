"""A tiny, deterministic byte-level BPE tokenizer with a ChatML chat template, built in milliseconds.

Byte-level BPE (GPT-2 style) can encode any text; characters missing from the small training corpus
split into single-byte tokens, so multi-byte UTF-8 characters span several tokens as they do with
real tokenizers. Use it for tests and for tiny random models (vocabulary size: ``len(tokenizer)``).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VOCAB_SIZE = 400

CORPUS = (
    "héllo wörld 日本語 😀 the quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts several tokens; the model verifies them in one step.",
    "Accepted tokens and a bonus token are emitted together, then the next step begins.",
    "user: what is the capital of France? assistant: The capital of France is Paris.",
    "Ünïcödé tëxt, naïve café, 東京 and 大阪, emoji 🚀🎉 and numbers 0123456789!",
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Train the tiny tokenizer on ``CORPUS`` (same result on every call).

    Special tokens: ``<|endoftext|>`` (id 0, eos and pad), ``<|im_start|>`` (1), ``<|im_end|>`` (2).
    """
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS_TOKEN, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
    )


def save_tiny_tokenizer(path: str | Path) -> Path:
    """Save the tiny tokenizer to ``path`` so that ``AutoTokenizer.from_pretrained(path)`` loads it."""
    path = Path(path)
    make_tiny_tokenizer().save_pretrained(str(path))
    return path
