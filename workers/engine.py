"""The engine: in-flight batching of many requests over one base model and a ReDrafter draft head.

A request's way through the engine: :meth:`Engine.add_request` queues it; every :meth:`Engine.step`
(one iteration) the scheduler plans context chunks (chunked prefill) and generation steps under the
batch and token budgets, the speculation schedule picks the draft-tree shape for the number of
generation requests, and the model runner executes the plan in one base-model forward
(ReDrafter arXiv 2403.09919 Sec. 3: draft beams, prefix tree, tree attention, longest accepted
prefix plus a bonus token). Each step returns the requests' new text; finished and aborted requests
free their KV blocks before the next iteration.

The engine is synchronous and single-threaded; :mod:`workers.async_engine` runs it on a background
thread for servers.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from workers.block_manager import BlockManager, KVCacheSize
from workers.engine_metrics import EngineStats, EngineStatsDelta
from workers.engine_options import EngineOptions
from workers.logprobs import TokenText, compute_logprobs
from workers.model_runner import ModelRunner, RequestState
from workers.models.tokenizer import apply_chat_template
from workers.outputs import GenerationDelta, TokenLogprob
from workers.prefix_hash import block_hashes
from workers.redrafter.prompt_lookup import PromptLookup
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, SchedulerConfig
from workers.sequence import Sequence
from workers.speculation.options import SpeculationOptions
from workers.speculation.policy import SelectedPolicy
from workers.stopping import OutputStream
from workers.structured.errors import GrammarError
from workers.thread_policy import ThreadPolicy

MODES = ("spec", "plain")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ComputePath:
    """What the engine computes on: its name (:mod:`workers.compute_path`, e.g. ``gguf-avx512-int8``),
    the GGUF weights in use (None: the model's dense weights), the prompt and decode activation
    dtypes (``"float32"``/``"bfloat16"``, ``"float32"``/``"int8"``), and what else its step times
    depend on (:func:`workers.speculation.policy.step_time_conditions`: KV cache dtype, threads), as
    ``rdserve calibrate`` records them."""

    name: str
    weights: object | None
    prefill_dtype: str
    decode_activations: str
    step_conditions: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state at one moment (:meth:`Engine.snapshot`).

    running, waiting: requests decoding / queued.
    free_blocks, num_blocks: free and total paged KV-cache blocks.
    kv_size: the KV cache's size (blocks, tokens per block, bytes per token), fixed at start.
    failure: why the executor is unusable (a lost tensor-parallel rank), None while it is healthy.
    spec_stats: the speculation policy's ``stats()``: ``shape`` (``"BxD"`` or None) and ``tau``
        (tokens per drafted step, or None), plus what else the policy reports.
    cached_blocks: blocks registered in the prefix cache (held or evictable; evictable ones also
        count in ``free_blocks``).
    """

    running: int
    waiting: int
    free_blocks: int
    num_blocks: int
    kv_size: KVCacheSize
    failure: BaseException | None
    spec_stats: dict
    cached_blocks: int = 0

    @property
    def kv_usage(self) -> float:
        """Fraction of KV-cache blocks in use (0-1)."""
        return 1.0 - self.free_blocks / self.num_blocks if self.num_blocks else 0.0


class Engine:
    """The iteration loop over built parts (:func:`workers.engine_builder.load_engine` builds them
    from a model directory and options)."""

    def __init__(self, model, tokenizer, drafter, executor, blocks: BlockManager, kv_size: KVCacheSize,
                 policy: SelectedPolicy, lookup: PromptLookup | None, options: EngineOptions,
                 speculation: SpeculationOptions, compute: ComputePath, max_seq_len: int,
                 thread_policy: ThreadPolicy | None = None):
        self.model, self.config, self.tokenizer, self.drafter = model, model.config, tokenizer, drafter
        self.executor, self.blocks, self.kv_size = executor, blocks, kv_size
        self.spec_selection, self.spec_policy, self.lookup = policy, policy.policy, lookup
        self.options, self.speculation, self.max_seq_len = options, speculation, max_seq_len
        self.compute_path, self.weights = compute.name, compute.weights
        self.prefill_dtype, self.decode_activations = compute.prefill_dtype, compute.decode_activations
        self.step_conditions = dict(compute.step_conditions)  # what rdserve calibrate records beside the path
        self.device, self.thread_policy = torch.device(options.device), thread_policy
        self.runner = ModelRunner(executor, blocks, drafter, lookup, speculation.draft_search)
        # one CPU process with a bfloat16 prefill: an iteration's prompt chunks and decode rows in two
        # forwards, so the decode rows keep the fused C decoder (ModelRunner._forward_apart)
        self.runner.split_mixed = self.device.type == "cpu" and options.tp_size == 1 and self.prefill_dtype == "bfloat16"
        self.scheduler = Scheduler(SchedulerConfig(options.max_batch_size, options.max_num_tokens,
                                                   options.max_prefill_chunk, max_seq_len,
                                                   lookup.longest if lookup else 0), blocks)
        self.stats: EngineStats | None = None  # counts for metrics when set (cluster.observability)
        self.last_context_requests = 0  # requests with a prompt chunk in the last iteration
        self.last_context_tokens = 0  # prompt positions computed in the last iteration
        self.eos_token_ids = set(model.config.eos_token_id)
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.token_text = TokenText(tokenizer)
        self._grammars = None  # workers.structured.compiler.GrammarCompiler, built at first use
        self._grammars_lock = threading.Lock()

    @property
    def forced_shape(self) -> tuple[int, int] | None:
        """The tree of requests that force speculation (``add_request(force_draft=True)``) in an
        iteration the policy decodes plain: ``num_beams x draft_len_per_beam`` when the policy's
        shapes (which the KV cache is sized for) include it, else the policy's smallest shape; None
        when the policy never drafts."""
        shapes = self.spec_policy.shapes
        configured = (self.speculation.num_beams, self.speculation.draft_len_per_beam)
        if configured in shapes:
            return configured
        return min(shapes, key=lambda s: s[0] * s[1]) if shapes else None

    @property
    def speculative_available(self) -> bool:
        return self.drafter is not None

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` (and ``tools``, OpenAI's list) rendered with the chat template
        (:mod:`workers.models.tool_prompt` for tools and tool messages).

        Raises:
            ValueError: no chat template, the template rejects the messages, or a malformed tool call.
        """
        return apply_chat_template(self.tokenizer, messages, tools)

    def compile_grammar(self, spec):
        """The compiled grammar of a :class:`workers.structured.spec.GrammarSpec` (cached by spec; the
        compiler, ~0.3 s, is built at the first call). Thread-safe: servers compile off the engine thread.

        Raises:
            GrammarError: the grammar cannot be compiled, or the grammar engine (xgrammar) is not
                installed (a ``ValueError``).
        """
        with self._grammars_lock:
            if self._grammars is None:
                try:
                    from workers.structured.compiler import GrammarCompiler
                except ImportError as err:
                    raise GrammarError("structured outputs need the xgrammar package: "
                                       "pip install 'rdserve[structured]'") from err
                self._grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size,
                                                 stop_token_ids=sorted(self.eos_token_ids))
        return self._grammars.compile(spec)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, mode: str,
                    force_draft: bool = False) -> None:
        """Queue a request. ``force_draft`` (with ``mode="spec"``): draft every step a tree fits,
        whatever the speculation policy says (:attr:`forced_shape` when it decodes plain).

        Raises:
            ValueError: empty prompt, prompt that leaves no room in ``max_seq_len``, unknown mode,
                ``mode="spec"`` without a drafter, a request id in use, a request the KV cache
                could never hold, a grammar that does not compile (``GrammarError``), or a grammar
                with ``ignore_eos``.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "spec" and self.drafter is None:
            raise ValueError("speculative decoding needs a drafter (drafter.path is not set)")
        n_prompt = len(prompt_ids)
        if n_prompt == 0:
            raise ValueError("prompt is empty")
        if n_prompt >= self.max_seq_len:
            raise ValueError(f"prompt has {n_prompt} tokens; the context holds {self.max_seq_len}")
        budget = min(params.max_tokens, self.max_seq_len - n_prompt)
        params = replace(params, max_tokens=budget)
        seq = Sequence(request_id, list(prompt_ids), budget, speculative=mode == "spec",
                       force_draft=force_draft and mode == "spec")
        seed = None if params.greedy else params.seed if params.seed is not None else secrets.randbits(64)
        stop_ids = (frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)) | frozenset(params.stop_token_ids)
        grammar = None
        if params.grammar is not None and params.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a structured output: it ends where its grammar does")
        if params.grammar is not None:
            from workers.structured.matcher import RequestGrammar

            grammar = RequestGrammar(self.compile_grammar(params.grammar))
        seq.runner_state = RequestState(params, seed, stop_ids=stop_ids, grammar=grammar)
        seq.stream = OutputStream(self.tokenizer, params, self.eos_token_ids)
        if self.blocks.enable_prefix_caching:
            seq.block_hashes = block_hashes(seq.prompt_token_ids, self.blocks.block_size, params.cache_salt)
        if params.prompt_logprobs is not None:  # the first token's entry has no logprob: nothing predicts it
            seq.match_prefix = False  # every prompt position computed, so each gets its logprob
            seq.prompt_logprobs = [TokenLogprob(prompt_ids[0], *self.token_text(prompt_ids[0]), None, 0)] \
                + [None] * (n_prompt - 1)
        seq.spec_state = self.spec_policy.new_request_state()
        if self.stats:
            self.stats.on_added(request_id)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request; its KV blocks are free before the next iteration. False if unknown."""
        if self.stats:
            self.stats.on_aborted(request_id)
        return self.scheduler.abort(request_id) is not None

    def abort_all(self) -> list[str]:
        """:meth:`abort` every unfinished request, running ones first; returns their ids."""
        ids = [seq.request_id for seq in list(self.scheduler.running) + list(self.scheduler.waiting)]
        for request_id in ids:
            self.abort(request_id)
        return ids

    def snapshot(self) -> EngineSnapshot:
        """The engine's state now. Safe to call from another thread: it reads list lengths and
        counters only (each field is current, the set of them need not be from one instant)."""
        return EngineSnapshot(len(self.scheduler.running), len(self.scheduler.waiting),
                              self.blocks.num_free_blocks, self.blocks.num_blocks, self.kv_size,
                              self.executor.failure, self.spec_policy.stats(), self.blocks.num_cached_blocks)

    def drain_stats(self) -> EngineStatsDelta:
        """Counts since the last call and the state now (``self.stats`` must be set; engine thread only)."""
        used = 1 - self.blocks.num_free_blocks / self.blocks.num_blocks
        return self.stats.drain(len(self.scheduler.running), len(self.scheduler.waiting), used)

    @torch.inference_mode()
    def step(self) -> list[GenerationDelta]:
        """Run one iteration; returns a delta for each request that emitted tokens (or finished)."""
        t0, stats = time.perf_counter(), self.stats
        plan = self.scheduler.schedule(self.spec_policy, self.forced_shape)
        self.last_context_requests = len(plan.context)  # prompt chunks in this iteration (step-time stats)
        self.last_context_tokens = sum(n for _, _, n in plan.context)
        if not plan.context and not plan.generation:
            return []
        if stats:
            for seq, _, _ in plan.context:
                stats.on_scheduled(seq.request_id, t0)
        limits = {}  # draft tokens each request may still take this step (its max_tokens less one)
        for seq, draft in zip(plan.generation, plan.draft_tokens):
            remaining = seq.max_tokens - len(seq.output_token_ids)
            limits[seq.request_id] = remaining - 1 if draft and plan.spec_shape else 0
        full_depth = self.runner.max_draft_depth(plan.spec_shape) if plan.spec_shape else 0
        min_prob = self.spec_policy.min_draft_prob(len(plan.generation), plan.spec_shape) if plan.spec_shape else 0.0
        prune = {"min_draft_prob": min_prob} if min_prob > 0 else {}  # the run call is unchanged while pruning is off
        settled = True  # run on the thread count the thread policy settled on (not a probe of another)
        if self.thread_policy is None:
            results = self.runner.run(plan.context, plan.generation, plan.spec_shape, limits, **prune)
        else:
            rows, threads = plan.num_tokens, self.thread_policy.choose(plan.num_tokens, t0)
            settled = self.thread_policy.settled
            torch.set_num_threads(threads)
            results = self.runner.run(plan.context, plan.generation, plan.spec_shape, limits, **prune)
            self.thread_policy.observe(rows, threads, time.perf_counter() - t0)
        for seq, start, _ in plan.context:  # prompt blocks now computed join the prefix cache
            if seq.block_hashes:
                self.blocks.register(seq, seq.block_hashes, min(seq.num_computed_tokens, len(seq.prompt_token_ids)))
            # its first admission, if it looked the cache up (caching on, no prompt logprobs asked)
            if (stats and self.blocks.enable_prefix_caching and seq.match_prefix and seq.num_preemptions == 0
                    and start == seq.cached_tokens):
                stats.on_prefix_cache(len(seq.prompt_token_ids), seq.cached_tokens)
        deltas, finished = [], []
        for r in results:
            if r.prompt_logits is not None:
                self._record_prompt_logprobs(r.seq, r.prompt_logits, r.prompt_start)
            if not r.tokens:
                continue
            seq, stream = r.seq, r.seq.stream
            emitted = len(stream.token_ids)
            out = stream.append(r.tokens)
            if r.generation_step:
                limit = limits.get(seq.request_id, 0)
                if r.draft_depth == 0:  # every draft token cut by confidence (prune_trees): a plain step
                    limits[seq.request_id] = limit = 0
                if limit == 0 or limit >= full_depth:  # a tree cut short by max_tokens tells nothing
                    self.spec_policy.observe(seq.spec_state, plan.spec_shape, limit > 0,
                                             r.accepted_draft_tokens, r.num_rows)
                seq.num_steps += 1
                # accepted draft tokens that were emitted (a stop inside the block drops the rest)
                accepted = min(r.accepted_draft_tokens, len(stream.token_ids) - emitted)
                seq.accepted_draft_tokens += accepted
                if stats:
                    stats.on_generation_step(r.draft_depth, accepted, r.grammar_rejected)
            if stats:
                stats.on_tokens(seq.request_id, len(seq.prompt_token_ids), emitted, len(stream.token_ids), out.finished)
            delta = GenerationDelta(
                out.text, out.token_ids, out.finished, out.finish_reason, len(seq.prompt_token_ids),
                len(stream.token_ids), seq.num_steps, seq.accepted_draft_tokens, seq.request_id,
                cached_tokens=seq.cached_tokens or 0,
            )
            params = seq.runner_state.params
            if params.logprobs is not None:  # the rows of the tokens kept: a stop cuts them where it cuts the text
                kept = out.token_ids
                values = compute_logprobs(r.token_logits[: len(kept)], kept, params.logprobs)
                delta.logprobs = [self.token_text.entry(t, *v) for t, v in zip(kept, values)]
            if seq.prompt_logprobs is not None and emitted == 0:
                delta.prompt_logprobs = seq.prompt_logprobs
            deltas.append(delta)
            if out.finished:
                finished.append(seq)
        # Finished only once every result is in: if one raises above, the requests that finished
        # earlier in this loop are still running, so the caller's failure handling ends them too.
        for seq in finished:
            self.scheduler.finish(seq)
        seconds = time.perf_counter() - t0
        if not plan.context:  # a generation-only iteration: a clean step-time sample for the policy
            full = sum(1 for n in limits.values() if full_depth and n >= full_depth)
            plain = sum(1 for n in limits.values() if n == 0)
            context = sum(s.num_tokens for s in plan.generation) / max(len(plan.generation), 1)
            rows = sum(r.num_rows for r in results if r.generation_step)
            emitted = sum(len(r.tokens) for r in results if r.generation_step)
            self.spec_policy.observe_step(plan.spec_shape, len(plan.generation), full, plain, seconds, context, rows,
                                          timed=settled, tokens=emitted)
        if stats:
            stats.on_iteration(len(plan.context), len(plan.generation), plan.spec_shape, len(plan.preempted),
                               seconds)
        return deltas

    def _record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, start: int) -> None:
        """Prompt tokens ``start ..`` get the logprobs of ``logits`` (``[n, V]``, row k predicts
        token ``start + k``); a chunk computed again after a preemption writes the same entries."""
        tokens = seq.prompt_token_ids[start : start + logits.shape[0]]
        values = compute_logprobs(logits, tokens, seq.runner_state.params.prompt_logprobs)
        for k, (token, value) in enumerate(zip(tokens, values)):
            seq.prompt_logprobs[start + k] = self.token_text.entry(token, *value)

    def generate(self, prompt_ids: list[int], params: SamplingParams, mode: str,
                 request_id: str = "generate", force_draft: bool = False) -> Iterator[GenerationDelta]:
        """Decode one request alone (other queued requests run too); yields its deltas, the last
        one finished. Closing the iterator early aborts the request.

        Raises:
            ValueError: see :meth:`add_request`.
        """
        self.add_request(request_id, prompt_ids, params, mode, force_draft)
        finished = False
        try:
            while not finished:
                for d in self.step():
                    if d.request_id == request_id:
                        finished = d.finished
                        yield d
        finally:
            if not finished:
                self.abort(request_id)

    def close(self) -> None:
        self.executor.close()
