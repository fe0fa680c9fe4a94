"""The unit of work of in-flight batching: one request's tokens, KV-cache progress and block table.

Token accounting (what the scheduler plans with and what the engine updates after each forward):

- ``num_tokens = len(prompt_token_ids) + len(output_token_ids)``.
- ``num_computed_tokens``: leading tokens whose keys/values are in the paged KV cache.
- The last emitted token has no KV yet: a generation step feeds it (plus the draft tree, if any), so
  generation can run once every token before it is computed. ``num_context_tokens`` counts those
  tokens: ``num_tokens - 1`` when the sequence has outputs, ``num_tokens`` (the whole prompt) before
  the first output token.
- Context phase (``is_prefill``): ``num_computed_tokens < num_context_tokens``. The scheduler plans
  prefill chunks ``[num_computed_tokens, num_computed_tokens + n)``. After a chunk the engine adds
  ``n`` to ``num_computed_tokens``; when the chunk completes a prompt that has no output yet, the
  engine samples the first output token from the chunk's last position. After a preemption
  (``num_computed_tokens`` reset to 0) the recomputed context covers prompt + outputs except the last
  output token, and nothing is sampled at its end: the last output token is already known.
- Generation phase: ``num_computed_tokens == num_tokens - 1``. A generation step writes the last
  token and the draft tree at positions ``num_computed_tokens ..``; the engine then adds
  ``1 + accepted`` to ``num_computed_tokens`` and appends ``accepted + 1`` tokens (accepted drafts
  plus the bonus token) to ``output_token_ids`` (ReDrafter arXiv 2403.09919 Sec. 3.3).

Names follow TensorRT-LLM (context/generation phase) and vLLM (block table).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.model_runner import RequestState
    from workers.redrafter.prompt_lookup import NgramIndex
    from workers.stopping import OutputStream


class SequenceStatus(enum.Enum):
    """WAITING: queued, holds no KV blocks (new, or preempted for recompute). RUNNING: admitted,
    holds blocks. FINISHED: done or aborted, blocks freed."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class LookupState:
    """A request's prompt-lookup beam (:mod:`workers.redrafter.prompt_lookup`), kept by the model runner.

    index: n-gram index over the request's prompt and output tokens, built at its first lookup
        (None before).
    length: tokens the next lookup beam may draft, set after each step that drafted one
        (``PromptLookup.next_length``); None before: the start length (``PromptLookup.num_tokens``),
        for which the scheduler reserves ``SchedulerConfig.lookup_tokens`` tree slots.
    """

    index: NgramIndex | None = None
    length: int | None = None


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it.

    request_id: unique among unfinished sequences.
    max_tokens: most output tokens the request may produce (>= 1); sizes the admission check.
    speculative: whether the request may be decoded with a draft tree (False = plain steps only).
    force_draft: a speculative request that drafts every step a tree fits, whatever the speculation
        policy says (a request that forces ``rdserve.mode: spec``; see ``Scheduler.schedule``).
    arrival_index: FCFS position, set by ``Scheduler.add`` (-1 before).
    block_table: KV-cache block ids; token at position p lives in block ``block_table[p // block_size]``.

    Kept by the engine and the model runner (the defaults stay on a sequence built without an engine):

    runner_state: sampling parameters, seed and the drafter's context hidden state; set by the
        engine when it queues the request, read and updated by the model runner.
    stream: detokenizer and stop rules the engine appends each step's tokens to.
    num_steps: generation-phase steps so far; accepted_draft_tokens: drafted tokens accepted and
        emitted so far (the engine counts both, for its ``GenerationDelta``).
    spec_state: the speculation policy's per-request state (``policy.new_request_state()``; opaque
        here): the scheduler passes it to ``policy.drafts`` and the engine to ``policy.observe``.
    lookup: the prompt-lookup beam; the model runner updates it and the scheduler reserves tree
        slots for ``lookup.length``.
    block_hashes: chain hashes of the prompt's full blocks (:mod:`workers.prefix_hash`), for the
        prefix cache; set by the engine when it queues the request (empty with caching off).
    match_prefix: whether the request may start from cached blocks (False for a request that asked for
        prompt logprobs: a cached position is never computed, so it would have no logprob; vLLM does
        the same). Its computed blocks still enter the cache for others.
    cached_tokens: prompt tokens taken from the prefix cache at the request's first admission
        (OpenAI's ``usage.prompt_tokens_details.cached_tokens``); None before it was admitted.
    prompt_logprobs: for a request that asked for them, one ``TokenLogprob`` per prompt token (None
        until computed; the first has no logprob), filled chunk by chunk by the engine and sent with
        its first output; None for other requests.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    speculative: bool = True
    force_draft: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    arrival_index: int = -1
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    runner_state: RequestState | None = None
    stream: OutputStream | None = None
    num_steps: int = 0
    accepted_draft_tokens: int = 0
    spec_state: object | None = None
    lookup: LookupState = field(default_factory=LookupState)
    prompt_logprobs: list | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    match_prefix: bool = True
    cached_tokens: int | None = None

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_context_tokens(self) -> int:
        """Tokens to prefill before generation can (re)start, see the module docstring."""
        return self.num_tokens - 1 if self.output_token_ids else self.num_tokens

    @property
    def is_prefill(self) -> bool:
        """Context phase: part of the context still lacks KV."""
        return self.num_computed_tokens < self.num_context_tokens

    @property
    def max_slots(self) -> int:
        """KV slots a plain generation step needs at the sequence's longest: the last step feeds
        token ``len(prompt) + max_tokens - 2``."""
        return len(self.prompt_token_ids) + self.max_tokens - 1
