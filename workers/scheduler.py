"""In-flight batching scheduler: which sequences run this iteration, and how many tokens each.

Each iteration (:meth:`Scheduler.schedule`) plans, under ``max_batch_size`` sequences and
``max_num_tokens`` tokens (TensorRT-LLM option names; draft-tree tokens count):

1. Generation phase first, oldest first: every running sequence whose context is computed gets one
   step of ``1 + tree_tokens`` tokens, where ``tree_tokens = num_beams * draft_len_per_beam`` (plus
   ``lookup_tokens`` for a prompt-lookup beam) for the shape the speculation schedule gives for the
   number of generation-phase sequences, or 0 (plain) for a non-speculative request, when the tree
   would pass ``max_seq_len``, exceed the token budget, or need KV blocks that are not free.
2. Context phase, FCFS: running sequences with a partly computed context, then waiting sequences
   (new or preempted; none in an iteration that preempted, as in vLLM), in chunks of at most
   ``max_prefill_chunk`` tokens (chunked prefill, as in vLLM and Sarathi-Serve) until a budget or
   the free blocks run out; admission stops at the first waiting sequence that does not fit. A
   waiting sequence first takes its prompt's longest chain of cached blocks (prefix caching,
   :meth:`BlockManager.match_prefix`) and prefills from there, always at least its last context token
   (the drafter needs that position's hidden state).

Preemption by recompute (vLLM): when a running sequence cannot get even the KV blocks of a plain
step (or of one context token), the most recently arrived running sequence is preempted: its blocks
are freed, it goes back to WAITING with ``num_computed_tokens = 0``, and it is recomputed later.
Only sequences younger than the one being served are preempted. Admission is FCFS and preemption
takes the youngest, so every running sequence arrived before every waiting one; the oldest running
sequence can always take every block, and admission rejects a sequence that could not run alone in
the whole cache, so the oldest sequence always progresses and no request starves.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from workers.block_manager import BlockManager
from workers.sequence import Sequence, SequenceStatus
from workers.speculation.schedule import Shape, SpecSchedule, TablePolicy


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-iteration budgets.

    max_batch_size: sequences running at once (admitted and not finished), hence per iteration.
    max_num_tokens: tokens in one forward: context chunks + ``1 + tree_tokens`` per generation step.
    max_prefill_chunk: most context tokens of one sequence per iteration; None = ``max_num_tokens``.
    max_seq_len: positions a sequence may use (the model's context length); draft trees that would
        pass it are skipped; None = unlimited.
    lookup_tokens: tree slots a speculative step reserves beyond ``num_beams * draft_len_per_beam``
        for its prompt-lookup beam (:mod:`workers.redrafter.prompt_lookup`); 0 = none. A sequence
        whose beam has grown (``seq.lookup.length``, kept by the model runner, which drafts
        exactly that many) reserves its own length instead, so a long beam costs budget only while
        it is long.
    """

    max_batch_size: int
    max_num_tokens: int
    max_prefill_chunk: int | None = None
    max_seq_len: int | None = None
    lookup_tokens: int = 0

    def __post_init__(self):
        for name in ("max_batch_size", "max_num_tokens", "max_prefill_chunk", "max_seq_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {value}")
        if self.lookup_tokens < 0:
            raise ValueError(f"SchedulerConfig.lookup_tokens must be >= 0, got {self.lookup_tokens}")


@dataclass
class SchedulePlan:
    """One iteration's work; any part may be empty.

    context: ``(seq, start, num_tokens)``: prefill positions ``[start, start + num_tokens)``.
    generation: sequences taking one generation step, oldest first.
    draft_tokens: per ``generation`` entry, the draft-tree slots reserved (0 = plain step); a
        speculative step's tree holds at most ``spec_shape[0] * spec_shape[1] + lookup_tokens`` tokens.
    preempted: sequences preempted while planning (blocks already freed, now WAITING).
    spec_shape: ``(num_beams, draft_len_per_beam)`` for this iteration, None when no entry drafts.
    """

    context: list[tuple[Sequence, int, int]] = field(default_factory=list)
    generation: list[Sequence] = field(default_factory=list)
    draft_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    spec_shape: Shape | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens of the forward: context chunks plus ``1 + draft_tokens`` per generation step."""
        return sum(n for _, _, n in self.context) + len(self.generation) + sum(self.draft_tokens)

    @property
    def num_seqs(self) -> int:
        return len(self.context) + len(self.generation)


class Scheduler:
    """FCFS queues of one engine replica, planning each iteration over a :class:`BlockManager`.

    ``waiting`` and ``running`` are in arrival order. The engine adds sequences with :meth:`add`,
    runs :meth:`schedule`'s plan, updates each sequence's tokens (see ``workers.sequence``), and
    calls :meth:`finish` or :meth:`abort`, which free the blocks.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._arrivals = itertools.count()

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence behind every earlier one (sets its ``arrival_index``).

        Raises:
            ValueError: the request id is in use, or the sequence could never run: its
                ``len(prompt) + max_tokens - 1`` KV slots exceed the whole cache (or ``max_seq_len``).
        """
        if seq.request_id in self._by_id:
            raise ValueError(f"request {seq.request_id} is already queued")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if seq.max_slots > capacity:
            raise ValueError(
                f"request {seq.request_id}: prompt ({len(seq.prompt_token_ids)} tokens) + max_tokens "
                f"({seq.max_tokens}) needs {seq.max_slots} KV slots, the cache holds {capacity}"
            )
        if self.config.max_seq_len is not None and seq.max_slots > self.config.max_seq_len:
            raise ValueError(
                f"request {seq.request_id}: prompt ({len(seq.prompt_token_ids)} tokens) + max_tokens "
                f"({seq.max_tokens}) exceeds max_seq_len {self.config.max_seq_len}"
            )
        seq.status = SequenceStatus.WAITING
        seq.arrival_index = next(self._arrivals)
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def finish(self, seq: Sequence) -> None:
        """Mark a sequence FINISHED (stop token, ``max_tokens``) and free its blocks."""
        self.abort(seq.request_id)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a waiting or running sequence, mark it FINISHED and free its blocks; None if no
        unfinished sequence has this id."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        del self._by_id[seq.request_id]
        return seq

    def schedule(self, spec: SpecSchedule | TablePolicy = "off", forced_shape: Shape | None = None) -> SchedulePlan:
        """Plan one iteration (see the module docstring).

        ``spec``: a validated speculation table, or a policy (:class:`TablePolicy`, or the live
        goodput model) that gives the shape for the number of generation requests and whether each
        speculative request drafts (``policy.drafts(seq.spec_state, b, shape)``).
        ``forced_shape``: the tree of ``force_draft`` requests in an iteration the policy decodes
        plain (then only they draft); in other iterations they draft at the policy's shape whatever
        ``policy.drafts`` says. None: they follow the policy like the others.
        """
        policy = spec if hasattr(spec, "shape_for") else TablePolicy(spec)
        plan = SchedulePlan()
        generating = [s for s in self.running if not s.is_prefill]
        policy.observe_context(sum(s.num_tokens for s in generating) / len(generating) if generating else None)
        shape = policy.shape_for(len(generating))
        by_policy = shape is not None
        if shape is None and forced_shape is not None and any(s.force_draft and s.speculative for s in generating):
            shape = forced_shape
        tree_tokens = shape[0] * shape[1] if shape else 0
        for seq in generating:
            if seq.status is SequenceStatus.RUNNING:
                drafts = bool(tree_tokens) and seq.speculative and (seq.force_draft or by_policy and policy.drafts(
                    seq.spec_state, len(generating), shape))
                lookup = 0 if not self.config.lookup_tokens else \
                    self.config.lookup_tokens if seq.lookup.length is None else seq.lookup.length
                self._plan_generation(seq, tree_tokens + lookup if drafts else 0, plan)
        self._plan_context_phase(plan)
        plan.spec_shape = shape if any(plan.draft_tokens) else None  # preemption may drop trees
        return plan

    def _plan_context_phase(self, plan: SchedulePlan) -> None:
        chunk_cap = self.config.max_prefill_chunk or self.config.max_num_tokens
        for seq in [s for s in self.running if s.is_prefill]:
            if seq.status is SequenceStatus.RUNNING and not self._plan_context(seq, chunk_cap, plan):
                return
        while self.waiting and not plan.preempted and len(self.running) < self.config.max_batch_size:
            if not self._plan_context(self.waiting[0], chunk_cap, plan):
                return
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _plan_generation(self, seq: Sequence, tree_tokens: int, plan: SchedulePlan) -> None:
        tokens_left = self.config.max_num_tokens - plan.num_tokens
        if tokens_left < 1:
            return
        draft = tree_tokens
        if (
            not seq.speculative
            or 1 + draft > tokens_left
            or (self.config.max_seq_len is not None and seq.num_tokens + draft > self.config.max_seq_len)
        ):
            draft = 0
        bm = self.block_manager
        if draft and not bm.can_allocate(seq, seq.num_tokens + draft):
            draft = 0  # a plain step is cheaper than preempting a sequence for a tree
        if not self._reserve(seq, seq.num_tokens + draft, plan):
            self._preempt(seq, plan)
            return
        plan.generation.append(seq)
        plan.draft_tokens.append(draft)

    def _plan_context(self, seq: Sequence, chunk_cap: int, plan: SchedulePlan) -> bool:
        """Plan a context chunk for ``seq``; False when nothing could be planned (stop: FCFS)."""
        tokens_left = self.config.max_num_tokens - plan.num_tokens
        if tokens_left < 1 or plan.num_seqs >= self.config.max_batch_size:
            return False
        bm = self.block_manager
        matched = seq.status is SequenceStatus.WAITING and not seq.block_table and seq.block_hashes and seq.match_prefix
        if matched:  # prefix cache: its longest cached chain, at least one context token left to compute
            seq.num_computed_tokens = bm.match_prefix(seq, seq.block_hashes, seq.num_context_tokens - 1)
        start = seq.num_computed_tokens
        if seq.status is SequenceStatus.RUNNING and not self._reserve(seq, start + 1, plan):
            self._preempt(seq, plan)
            return False
        reachable = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size
        num_tokens = min(seq.num_context_tokens - start, tokens_left, chunk_cap, reachable - start)
        if num_tokens < 1:
            if matched:  # not admitted after all: it holds nothing while it waits
                bm.free(seq)
                seq.num_computed_tokens = 0
            return False
        if seq.cached_tokens is None:
            seq.cached_tokens = start
        bm.allocate(seq, start + num_tokens)
        plan.context.append((seq, start, num_tokens))
        return True

    def _reserve(self, seq: Sequence, upto_slots: int, plan: SchedulePlan) -> bool:
        """Allocate slots ``[0, upto_slots)`` for running ``seq``, preempting running sequences
        younger than it (youngest first) as needed; False if even that is not enough."""
        while not self.block_manager.can_allocate(seq, upto_slots):
            victim = self.running[-1]
            if victim is seq:
                return False
            self._preempt(victim, plan)
        self.block_manager.allocate(seq, upto_slots)
        return True

    def _preempt(self, seq: Sequence, plan: SchedulePlan) -> None:
        """Free ``seq``'s blocks and queue it first for recompute; drop it from ``plan``."""
        if seq in plan.generation:
            i = plan.generation.index(seq)
            del plan.generation[i], plan.draft_tokens[i]
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
