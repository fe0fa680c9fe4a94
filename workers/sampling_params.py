"""Per-request sampling parameters: a plain dataclass with no torch import, so the HTTP ingress and the
request router can build and carry them without loading the engine (the math is in :mod:`workers.sampling`
and :mod:`workers.logits_processing`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.structured.spec import GrammarSpec

MAX_TOP_LOGPROBS = 20
"""Most alternatives per token a request may ask for (OpenAI's ``top_logprobs`` limit)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters (OpenAI names; vLLM's for its extensions).

    temperature 0 means greedy (argmax). top_k 0 means no top-k filter. ``stop`` holds stop strings;
    generation also stops at the model's EOS token ids unless ``ignore_eos``, and at ``stop_token_ids``
    (vLLM) always.

    Logits processors (:mod:`workers.logits_processing`), applied before temperature, top-k and top-p,
    in vLLM's order, each with the token history of the position it predicts (under speculation: the
    tree node's own path):

    - ``logit_bias``: ``((token_id, bias), ...)`` added to the logits (OpenAI, bias in [-100, 100]).
    - ``repetition_penalty`` (vLLM, CTRL arXiv 1909.05858): a logit of a token seen in the prompt or
      the output is divided by it when positive, multiplied when negative; 1.0 is off.
    - ``frequency_penalty`` / ``presence_penalty`` (OpenAI): subtract ``count * frequency_penalty``
      and ``presence_penalty`` once for every token already in the output (not the prompt).
    - ``min_tokens`` (vLLM): EOS and ``stop_token_ids`` are forbidden before this many output tokens.

    Logprobs: ``logprobs`` None is off; ``k >= 0`` returns each output token's logprob and its ``k``
    most likely alternatives; ``prompt_logprobs`` likewise for the prompt tokens (completions'
    ``echo`` with ``logprobs``, vLLM's ``prompt_logprobs``). Values are the base model's raw
    log-softmax (vLLM's default ``logprobs_mode: raw_logprobs``: before the processors above and
    before temperature).

    ``grammar``: structured output (:mod:`workers.structured`): at every position only the tokens
    the grammar allows keep their logits (applied after the processors above), EOS only where the
    output is complete.

    ``cache_salt`` (vLLM's request field, carried here): the prefix cache shares blocks only between
    requests with the same salt (None is a salt of its own), for tenants that must not share.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None
    cache_salt: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_processors(self) -> bool:
        """Whether any logits processor changes the logits (then argmax and sampling read processed logits)."""
        return bool(self.logit_bias or self.repetition_penalty != 1.0 or self.frequency_penalty
                    or self.presence_penalty or self.min_tokens or self.grammar)
