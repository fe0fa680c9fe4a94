"""Token logprobs: the base model's log-softmax at each emitted (or prompt) token, and its most likely
alternatives, as the OpenAI API returns them.

The values are raw (vLLM's default ``logprobs_mode: raw_logprobs``): the log-softmax of the logits the
verification pass computed for the row that chose the token, before logit bias, penalties, a grammar's
mask and temperature. Under speculation the row of a drafted token is its tree node's parent's row, the
same position and context plain decoding computes, so on a compute path whose rows do not depend on
the rows beside them (float32, GGUF int8) speculative and plain decoding report identical logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from workers.outputs import TokenLogprob, TopLogprob


def compute_logprobs(logits: torch.Tensor, token_ids: list[int],
                     num_top: int) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """Each row's logprob of its token, that token's rank and the row's ``num_top`` most likely tokens.

    logits: ``[N, V]`` (any float dtype, any device; computed in float32); token_ids: N ids, row i's
    chosen token. Returns N ``(logprob, rank, [(token_id, logprob), ...])``: rank 1 is the most likely
    token (1 + the tokens strictly more likely); alternatives most likely first, ties by lower id (a
    stable descending sort).
    """
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
    chosen = logprobs.gather(1, torch.tensor(token_ids, dtype=torch.long).unsqueeze(1))
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    if num_top <= 0:
        return [(lp, rank, []) for lp, rank in zip(chosen, ranks)]
    top_values, top_ids = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1, sorted=True)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [(lp, rank, sorted(zip(ids, values), key=lambda e: (-e[1], e[0])))
            for lp, rank, ids, values in zip(chosen, ranks, top_ids, top_values)]


@dataclass
class TokenText:
    """Token ids to the text and UTF-8 bytes the OpenAI API shows for a token.

    For byte-level BPE tokenizers (GPT-2 style, as SmolLM2's) ``bytes`` are the token's own bytes,
    so a character split over several tokens is rebuilt by joining their bytes; ``text`` is those
    bytes decoded (U+FFFD for an incomplete character). Special tokens and other tokenizers: the
    token's decoded text (special tokens by their name, e.g. ``<|im_end|>``) and its UTF-8 bytes.
    """

    tokenizer: object

    def __post_init__(self):
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte <-> char table

        self._byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
        self._special = set(getattr(self.tokenizer, "all_special_ids", ()))
        self._describe = lru_cache(maxsize=65536)(self._describe_uncached)

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        return self._describe(token_id)

    def _describe_uncached(self, token_id: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:  # an id past the tokenizer's vocabulary (padded logits)
            return "", []
        if token_id not in self._special and all(ch in self._byte_of for ch in piece):
            raw = bytes(self._byte_of[ch] for ch in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = piece if token_id in self._special else self.tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))

    def entry(self, token_id: int, logprob: float, rank: int, top: list[tuple[int, float]]) -> TokenLogprob:
        text, raw = self(token_id)
        return TokenLogprob(token_id, text, raw, logprob, rank, [TopLogprob(t, *self(t), lp) for t, lp in top])
