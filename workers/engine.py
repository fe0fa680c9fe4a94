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
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from workers.block_manager import BlockManager, KVCacheSize, kv_bytes_per_token, size_kv_cache
from workers.engine_metrics import EngineStats, EngineStatsDelta
from workers.executor import LocalExecutor
from workers.model_runner import ModelRunner, RequestState
from workers.outputs import GenerationDelta
from workers.kernels.prefill_bf16 import resolve_prefill_dtype
from workers.models.gguf_weights import resolve_weights, use_bf16_prefill, use_gguf_weights, use_int8_activations
from workers.models.loader import load_model
from workers.models.tokenizer import apply_chat_template, load_tokenizer
from workers.redrafter.beam_search import DRAFT_SEARCHES
from workers.redrafter.drafter import load_drafter
from workers.redrafter.prompt_lookup import PromptLookup
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, SchedulerConfig
from workers.sequence import Sequence
from workers.spec_schedule import TablePolicy, fixed_schedule, validate_schedule
from workers.stopping import OutputStream
from workers.thread_policy import ThreadPolicy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("spec", "plain")
DECODE_ACTIVATIONS = ("auto", "float32", "int8")
log = logging.getLogger(__name__)


@dataclass
class EngineOptions:
    """Engine settings (TensorRT-LLM option names where they exist).

    num_beams, draft_len_per_beam: the draft-tree shape when ``spec_schedule`` is None (then used at
        every batch size).
    spec_schedule: ``"off"`` or rows ``{max_batch_size, num_beams, draft_len_per_beam}``
        (:mod:`workers.spec_schedule`), or ``"auto"``: the engine is given a live policy
        (``spec_policy``, built by ``cluster.local_engine`` from the goodput model).
    max_batch_size, max_num_tokens, max_prefill_chunk: scheduler budgets per iteration.
    tokens_per_block: paged KV-cache block size; num_kv_blocks or kv_cache_fraction (of memory
        available after loading the weights) sizes the cache; it is capped at what
        ``max_batch_size`` full-length sequences need.
    tp_size: tensor-parallel ranks of the executor (sizes each rank's share of the KV cache).
    num_threads: intra-op threads (None: torch's default). adaptive_threads: on a CPU engine on
        rdserve's C kernels without tensor parallelism, each step runs on the thread count (at most ``num_threads``)
        its measured step times favour (:mod:`workers.thread_policy`), so a core taken by another
        process costs in proportion instead of stalling every step; outputs are unchanged.
    weights: ``"auto"`` (the model's GGUF quantized blocks where the model came from one and the
        engine runs float32 on CPU, else float32), ``"gguf"`` or ``"float32"``
        (:mod:`workers.models.gguf_weights`). On GGUF blocks the drafter runs on Q8_0 blocks too
        (:mod:`workers.redrafter.quantize`).
    prefill_dtype: ``"auto"``, ``"float32"`` or ``"bfloat16"``: the prompt rows of GGUF-block linears
        in bfloat16 on oneDNN's AMX GEMM (:mod:`workers.kernels.prefill_bf16`); decode steps and draft
        trees stay float32. ``"auto"``: bfloat16 where the model is on GGUF blocks and the CPU has
        AMX bfloat16 tiles.
    decode_activations: ``"float32"``, ``"int8"`` or ``"auto"``: activations of the rows GGUF-block
        linears compute outside the bfloat16 prefill (decode steps, draft trees, recomputed tokens):
        float32 (output bit-identical to the dequantized float32 model), or int8 per 32-value block,
        llama.cpp's Q8_1 activations with integer dot products (AVX512-VNNI, or the same results on
        AVX2; :meth:`~workers.kernels.quant_linear.QuantLinear.enable_int8_activations`: a tree row
        costs a quarter (VNNI) to two thirds (AVX2) of a float32 one). Each row still depends on
        itself alone, so speculative output still equals plain output. ``"auto"``: int8 where the
        model is on GGUF blocks.
    spec_schedule_by_kernel: schedules (as ``spec_schedule``, not ``"auto"``) by the name of the
        compute path they were measured on (:mod:`workers.kernel_name`, e.g. ``gguf-avx512-int8``,
        ``gguf-avx2``); the engine takes the one of the path it runs on (:attr:`Engine.kernel`),
        otherwise ``spec_schedule``.
    prompt_lookup_num_tokens: tokens of a prompt-lookup beam added to every draft tree (0: none),
        matched on n-grams of ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens
        (:mod:`workers.redrafter.prompt_lookup`; vLLM's option names); after a step that accepted
        the whole beam it doubles, up to ``prompt_lookup_max_num_tokens`` (None: fixed length).
    draft_search: how the drafter's beams are chosen: ``"beam"``, ReDrafter's beam search (Sec. 3.2;
        TensorRT-LLM's), or ``"distinct_first"``, the ``num_beams`` most likely first tokens each
        continued greedily (:func:`workers.redrafter.beam_search.draft_distinct_first_batch`).
    """

    device: str = "cpu"
    dtype: str = "float32"
    num_beams: int = 2
    draft_len_per_beam: int = 2
    spec_schedule: str | list | None = None
    spec_schedule_by_kernel: dict | None = None
    max_seq_len: int = 2048
    max_batch_size: int = 16
    max_num_tokens: int = 2048
    max_prefill_chunk: int | None = 512
    tokens_per_block: int = 16
    num_kv_blocks: int | None = None
    kv_cache_fraction: float = 0.2
    num_threads: int | None = None
    adaptive_threads: bool = False
    tp_size: int = 1
    weights: str = "auto"
    prefill_dtype: str = "auto"
    decode_activations: str = "float32"
    prompt_lookup_num_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 3
    prompt_lookup_max_num_tokens: int | None = None
    draft_search: str = "distinct_first"


class Engine:
    """Loads a Hugging Face model directory and (optionally) a drafter directory.

    Raises:
        FileNotFoundError, ValueError: unreadable model/drafter, mismatched shapes, bad options.
    """

    def __init__(self, model_path: str, drafter_path: str | None, options: EngineOptions | None = None,
                 executor_factory=None, spec_policy=None, spec_policy_for_kernel=None, **overrides):
        """``overrides``: :class:`EngineOptions` fields replacing those of ``options``.

        ``executor_factory(model, num_slots)`` builds the executor (default :class:`LocalExecutor`;
        the tensor-parallel executor for ``tp_size > 1``). ``spec_policy``: a speculation policy
        with :class:`~workers.spec_schedule.TablePolicy`'s methods and ``shapes`` (needed when
        ``spec_schedule`` is ``"auto"``). ``spec_policy_for_kernel(kernel)``: instead, the policy for
        the compute path this engine turns out to run on (:attr:`kernel`, known once the weights are
        loaded), or None where it has none: the path's ``spec_schedule_by_kernel`` table, else (with
        ``spec_schedule`` ``"auto"``) the configured shape at batch 1 only, with a warning.
        """
        opts = replace(options or EngineOptions(), **overrides)
        if opts.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {opts.dtype!r}")
        resolve_prefill_dtype(opts.prefill_dtype)  # bad values fail before the model loads
        if opts.prompt_lookup_num_tokens < 0:
            raise ValueError(f"prompt_lookup_num_tokens must be >= 0 (0: no lookup beam), got {opts.prompt_lookup_num_tokens}")
        if opts.prompt_lookup_max_num_tokens is not None and opts.prompt_lookup_num_tokens == 0:
            raise ValueError("prompt_lookup_max_num_tokens is set but prompt_lookup_num_tokens is 0 (no lookup beam)")
        if opts.draft_search not in DRAFT_SEARCHES:
            raise ValueError(f"draft_search must be one of {', '.join(DRAFT_SEARCHES)}, got {opts.draft_search!r}")
        if opts.decode_activations not in DECODE_ACTIVATIONS:
            raise ValueError(f"decode_activations must be one of {', '.join(DECODE_ACTIVATIONS)}, "
                             f"got {opts.decode_activations!r}")
        self.lookup = None if opts.prompt_lookup_num_tokens == 0 else PromptLookup(
            opts.prompt_lookup_min, opts.prompt_lookup_max, opts.prompt_lookup_num_tokens,
            opts.prompt_lookup_max_num_tokens)
        if opts.num_threads:
            torch.set_num_threads(opts.num_threads)
        self.options = opts
        self.device = torch.device(opts.device)
        dtype = DTYPES[opts.dtype]
        model = load_model(model_path, dtype, opts.device)
        gguf = resolve_weights(opts.weights, model_path, opts.dtype, opts.device, opts.tp_size)
        self.weights = use_gguf_weights(model, gguf, strict=opts.weights == "gguf") if gguf else None
        self.prefill_dtype = self._prefill_path(model, opts.prefill_dtype)
        self.decode_activations = self._decode_activations(model, opts.decode_activations)
        self.kernel = self._kernel_name()
        # only on rdserve's C kernels, whose results are the same on any thread count (torch's GEMM's
        # need not be, and a request's steps would then depend on the counts chosen)
        on_kernels = opts.device == "cpu" and not self.kernel.endswith("-torch")
        self.thread_policy = ThreadPolicy(torch.get_num_threads()) \
            if opts.adaptive_threads and on_kernels and opts.tp_size == 1 and torch.get_num_threads() > 1 else None
        self.tokenizer = load_tokenizer(model_path)
        cfg = model.config
        self.config = cfg
        self.model = model
        self.max_seq_len = min(opts.max_seq_len, cfg.max_position_embeddings)
        self.drafter = None
        if drafter_path:
            # with the model on GGUF blocks the drafter runs on Q8_0 blocks too (workers/redrafter/quantize.py)
            self.drafter = load_drafter(drafter_path, model.lm_head.weight, dtype, opts.device,
                                        weight_format="Q8_0" if self.weights is not None else "float32")
            if self.decode_activations == "int8":  # its Q8_0 layers too: drafts only propose, exactness holds
                from workers.redrafter.quantize import use_int8_activations_in_drafter

                use_int8_activations_in_drafter(self.drafter)
        if spec_policy is None and spec_policy_for_kernel is not None:
            spec_policy = spec_policy_for_kernel(self.kernel)
        if spec_policy is not None:
            self.spec_policy = spec_policy
        elif self.kernel in (opts.spec_schedule_by_kernel or {}):
            self.spec_schedule = validate_schedule(opts.spec_schedule_by_kernel[self.kernel])
            log.info("speculation schedule of kernel %s (spec_schedule_by_kernel)", self.kernel)
        elif opts.spec_schedule == "auto" and spec_policy_for_kernel is None:
            raise ValueError("spec_schedule 'auto' needs a spec_policy (the goodput model; see cluster.local_engine)")
        elif opts.spec_schedule == "auto":
            self.spec_schedule = fixed_schedule((opts.num_beams, opts.draft_len_per_beam), 1)
            log.warning("spec_schedule 'auto': no calibration and no spec_schedule_by_kernel table for compute path "
                        "%s; speculating with %dx%d at batch 1 only. Run `rdserve calibrate` on this machine",
                        self.kernel, opts.num_beams, opts.draft_len_per_beam)
        elif opts.spec_schedule is None:
            self.spec_schedule = fixed_schedule((opts.num_beams, opts.draft_len_per_beam), opts.max_batch_size)
        else:
            self.spec_schedule = validate_schedule(opts.spec_schedule)
        self.kv_size = self._size_cache(cfg, dtype)
        log.info("%s", self.kv_size)
        self.blocks = BlockManager(self.kv_size.num_blocks, opts.tokens_per_block)
        make = executor_factory or LocalExecutor
        self.executor = make(model, self.blocks.num_slots - 1)
        self.runner = ModelRunner(self.executor, self.blocks, self.drafter, self.lookup, opts.draft_search)
        lookup_tokens = self.lookup.longest if self.lookup else 0
        self.scheduler = Scheduler(
            SchedulerConfig(opts.max_batch_size, opts.max_num_tokens, opts.max_prefill_chunk, self.max_seq_len,
                            lookup_tokens),
            self.blocks,
        )
        self.stats: EngineStats | None = None  # counts for metrics when set (cluster.observability)
        self.last_context_requests = 0  # requests with a prompt chunk in the last iteration
        self.eos_token_ids = set(cfg.eos_token_id)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

    def _prefill_path(self, model, setting: str) -> str:
        """Resolve ``prefill_dtype`` and give the GGUF linears their bfloat16 weights when it is
        bfloat16; returns ``"bfloat16"`` or ``"float32"``.

        Raises:
            ValueError: an unknown setting, or ``"bfloat16"`` without GGUF-block weights.
        """
        prefill = resolve_prefill_dtype(setting)
        if prefill == "bfloat16" and self.weights is None:
            if setting == "bfloat16":
                raise ValueError("prefill_dtype 'bfloat16' needs the model on GGUF blocks (weights 'gguf', or "
                                 "'auto' with a GGUF model); float32 weights prefill in float32")
            prefill = "float32"
        if prefill == "bfloat16":
            n = use_bf16_prefill(model)
            log.info("prefill: prompt rows of %d GGUF linears in bfloat16 (oneDNN AMX)", n)
        return prefill

    def _decode_activations(self, model, setting: str) -> str:
        """Resolve ``decode_activations`` and switch the GGUF linears to int8 activations when it is
        int8; returns ``"int8"`` or ``"float32"``.

        Raises:
            ValueError: ``"int8"`` without GGUF-block weights.
        """
        if setting == "int8" and self.weights is None:
            raise ValueError("decode_activations 'int8' needs the model on GGUF blocks (weights 'gguf', or 'auto' "
                             f"with a GGUF model, and tp_size 1; got weights {self.options.weights!r}, "
                             f"tp_size {self.options.tp_size})")
        if setting == "auto":  # int8 wherever some layer is on Q4_1/Q8_0 blocks (the C kernels loaded)
            setting = "int8" if self.weights is not None and bool(self.weights.quantized) else "float32"
        if setting == "int8":
            from workers.kernels.quant_linear import best_int8_kernel

            n = use_int8_activations(model)
            log.info("decode: %d GGUF linears take int8 activations (%s kernel)", n, best_int8_kernel())
        return setting

    def _kernel_name(self) -> str:
        """:func:`workers.kernel_name.kernel_name` of the path this engine computes on."""
        from workers.kernel_name import kernel_name
        from workers.kernels import build

        isa = build.load() if self.device.type == "cpu" and self.options.dtype == "float32" and build.available() \
            else None
        weights = "gguf" if self.weights is not None and self.weights.quantized else self.options.dtype
        return kernel_name(self.device.type, weights, isa, self.decode_activations == "int8")

    def _size_cache(self, cfg, dtype) -> KVCacheSize:
        opts = self.options
        per_token = kv_bytes_per_token(cfg, dtype, opts.tp_size)
        max_tree = max((b * d for b, d in self.spec_policy.shapes), default=0)
        if max_tree and self.lookup:
            max_tree += self.lookup.longest
        need_tokens = opts.max_batch_size * (self.max_seq_len + max_tree + opts.tokens_per_block)
        cap = -(-need_tokens // opts.tokens_per_block)
        if opts.num_kv_blocks is not None:
            return size_kv_cache(per_token, opts.tokens_per_block, num_blocks=opts.num_kv_blocks)
        size = size_kv_cache(per_token, opts.tokens_per_block, kv_cache_fraction=opts.kv_cache_fraction,
                             free_bytes=_free_memory_bytes(self.device))
        return replace(size, num_blocks=min(size.num_blocks, cap))

    @property
    def spec_schedule(self):
        """The fixed speculation table in use, or ``"auto"`` for a live policy."""
        return self.spec_policy.table if isinstance(self.spec_policy, TablePolicy) else "auto"

    @spec_schedule.setter
    def spec_schedule(self, table) -> None:
        self.spec_policy = TablePolicy(validate_schedule(table))

    @property
    def forced_shape(self) -> tuple[int, int] | None:
        """The tree of requests that force speculation (``add_request(force_draft=True)``) in an
        iteration the policy decodes plain: ``num_beams x draft_len_per_beam`` when the policy's
        shapes (which the KV cache is sized for) include it, else the policy's smallest shape; None
        when the policy never drafts."""
        shapes = self.spec_policy.shapes
        configured = (self.options.num_beams, self.options.draft_len_per_beam)
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

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, mode: str,
                    force_draft: bool = False) -> None:
        """Queue a request. ``force_draft`` (with ``mode="spec"``): draft every step a tree fits,
        whatever the speculation policy says (:attr:`forced_shape` when it decodes plain).

        Raises:
            ValueError: empty prompt, prompt that leaves no room in ``max_seq_len``, unknown mode,
                ``mode="spec"`` without a drafter, a request id in use, or a request the KV cache
                could never hold.
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
        seq.extra["state"] = RequestState(params, seed)
        seq.extra["stream"] = OutputStream(self.tokenizer, params, self.eos_token_ids)
        seq.extra["steps"] = seq.extra["accepted"] = 0
        seq.extra["spec_state"] = self.spec_policy.new_request_state()
        if self.stats:
            self.stats.on_added(request_id)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request; its KV blocks are free before the next iteration. False if unknown."""
        if self.stats:
            self.stats.on_aborted(request_id)
        return self.scheduler.abort(request_id) is not None

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
        if self.thread_policy is None:
            results = self.runner.run(plan.context, plan.generation, plan.spec_shape, limits)
        else:
            rows, threads = plan.num_tokens, self.thread_policy.choose(plan.num_tokens, t0)
            torch.set_num_threads(threads)
            results = self.runner.run(plan.context, plan.generation, plan.spec_shape, limits)
            self.thread_policy.observe(rows, threads, time.perf_counter() - t0)
        deltas, finished = [], []
        for r in results:
            if not r.tokens:
                continue
            seq, stream = r.seq, r.seq.extra["stream"]
            emitted = len(stream.token_ids)
            out = stream.append(r.tokens)
            if r.generation_step:
                limit = limits.get(seq.request_id, 0)
                if limit == 0 or limit >= full_depth:  # a tree cut short by max_tokens tells nothing
                    self.spec_policy.observe(seq.extra["spec_state"], plan.spec_shape, limit > 0,
                                             r.accepted_draft_tokens)
                seq.extra["steps"] += 1
                # accepted draft tokens that were emitted (a stop inside the block drops the rest)
                accepted = min(r.accepted_draft_tokens, len(stream.token_ids) - emitted)
                seq.extra["accepted"] += accepted
                if stats:
                    stats.on_generation_step(r.draft_depth, accepted)
            if stats:
                stats.on_tokens(seq.request_id, len(seq.prompt_token_ids), emitted, len(stream.token_ids), out.finished)
            deltas.append(GenerationDelta(
                out.text, out.token_ids, out.finished, out.finish_reason, len(seq.prompt_token_ids),
                len(stream.token_ids), seq.extra["steps"], seq.extra["accepted"], seq.request_id,
            ))
            if out.finished:
                finished.append(seq)
        # Finished only once every result is in: if one raises above, the requests that finished
        # earlier in this loop are still running, so the caller's failure handling ends them too.
        for seq in finished:
            self.scheduler.finish(seq)
        if stats:
            stats.on_iteration(len(plan.context), len(plan.generation), plan.spec_shape, len(plan.preempted),
                               time.perf_counter() - t0)
        return deltas

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


def _free_memory_bytes(device: torch.device) -> int:
    """Memory available for the KV cache now: CUDA free memory, or the OS's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")
