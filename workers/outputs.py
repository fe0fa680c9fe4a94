"""What the engine streams back per request: plain data with no torch import, so the replica's callers
(the HTTP ingress, metrics) can read it without loading the engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GenerationDelta:
    """What one iteration added to a request's output.

    Counters are cumulative. ``num_steps`` counts generation-phase steps (forward passes after the
    context phase); ``accepted_draft_tokens`` counts drafted tokens the base model accepted and the
    request emitted.
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

    @property
    def tokens_per_step(self) -> float:
        """Mean (accepted draft tokens + 1) per generation step; 1.0 for plain decoding."""
        return (self.accepted_draft_tokens + self.num_steps) / self.num_steps if self.num_steps else 0.0
