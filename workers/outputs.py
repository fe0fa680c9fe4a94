"""What the engine streams back per request: plain data with no torch import, so the replica's callers
(the HTTP ingress, metrics) can read it without loading the engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TopLogprob:
    """One of a token's most likely alternatives: id, text, UTF-8 bytes, logprob (natural log)."""

    token_id: int
    token: str
    bytes: list[int]
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted (or prompt) token's logprob, its ``rank`` among the vocabulary (1 = most likely) and
    its ``top`` alternatives (:mod:`workers.logprobs`). The prompt's first token, which nothing
    predicts, has ``logprob`` None, rank 0 and no alternatives."""

    token_id: int
    token: str
    bytes: list[int]
    logprob: float | None
    rank: int
    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class GenerationDelta:
    """What one iteration added to a request's output.

    Counters are cumulative. ``num_steps`` counts generation-phase steps (forward passes after the
    context phase); ``accepted_draft_tokens`` counts drafted tokens the base model accepted and the
    request emitted.

    ``cached_tokens``: prompt tokens taken from the prefix cache (OpenAI's
    ``usage.prompt_tokens_details.cached_tokens``).
    ``logprobs``: one entry per token of ``token_ids`` when the request asked for logprobs (None
    otherwise). ``prompt_logprobs``: on the first delta of a request that asked for them, one entry
    per prompt token (the first with ``logprob`` None: nothing predicts it).
    """

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    num_steps: int
    accepted_draft_tokens: int
    request_id: str = ""
    logprobs: list[TokenLogprob] | None = None
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def tokens_per_step(self) -> float:
        """Mean (accepted draft tokens + 1) per generation step; 1.0 for plain decoding."""
        return (self.accepted_draft_tokens + self.num_steps) / self.num_steps if self.num_steps else 0.0
