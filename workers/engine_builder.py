"""Build an :class:`~workers.engine.Engine` from a model directory and options.

Everything that happens once, before the first iteration: load the model, choose its weight format
(GGUF blocks or float32), its prompt and decode paths and so the compute path's name; load the
drafter; pick the speculation policy for that compute path (:func:`workers.speculation.policy.select_policy`);
size the paged KV cache for the largest draft tree. The engine then receives the built parts.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from workers.block_manager import BlockManager, KVCacheSize, kv_bytes_per_token, size_kv_cache
from workers.compute_path import compute_path_name
from workers.engine import ComputePath, Engine
from workers.engine_options import EngineOptions
from workers.executor import LocalExecutor
from workers.kernels import build
from workers.kernels.prefill_bf16 import resolve_prefill_dtype
from workers.models.gguf_weights import resolve_weights, use_bf16_prefill, use_gguf_weights, use_int8_activations
from workers.models.loader import load_model
from workers.models.tokenizer import load_tokenizer
from workers.redrafter.drafter import load_drafter
from workers.redrafter.prompt_lookup import PromptLookup
from workers.speculation.options import SpeculationOptions
from workers.speculation.policy import SelectedPolicy, SpecPolicy, select_policy, step_time_conditions
from workers.thread_policy import ThreadPolicy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = DTYPES | {"int8": torch.int8}  # engine.kv_cache_dtype (int8: workers.kv_cache.quantize_rows)
log = logging.getLogger(__name__)


def split_options(options: EngineOptions | None = None, speculation: SpeculationOptions | None = None,
                  **overrides) -> tuple[EngineOptions, SpeculationOptions]:
    """``options`` and ``speculation`` with ``overrides`` applied, each keyword to the model that
    defines it (``num_beams=4`` to speculation, ``max_seq_len=256`` to the engine's).

    Raises:
        TypeError: a keyword neither defines.
        pydantic.ValidationError (a ValueError): a value out of bounds, naming the field.
    """
    engine_kw = {k: v for k, v in overrides.items() if k in EngineOptions.model_fields}
    spec_kw = {k: v for k, v in overrides.items() if k in SpeculationOptions.model_fields}
    unknown = sorted(set(overrides) - set(engine_kw) - set(spec_kw))
    if unknown:
        raise TypeError(f"unknown engine option(s) {', '.join(unknown)}: see workers.engine_options.EngineOptions "
                        "and workers.speculation.options.SpeculationOptions")
    # a config section (a subclass with serving fields) comes down to the engine's own fields
    options = EngineOptions.model_validate({k: getattr(options or EngineOptions(), k) for k in EngineOptions.model_fields}
                                           | engine_kw)
    speculation = SpeculationOptions.model_validate(
        {k: getattr(speculation or SpeculationOptions(), k) for k in SpeculationOptions.model_fields} | spec_kw)
    return options, speculation


def load_engine(model_path: str, drafter_path: str | None = None, options: EngineOptions | None = None,
                speculation: SpeculationOptions | None = None, executor_factory=None,
                spec_policy: SpecPolicy | None = None, **overrides) -> Engine:
    """Load the model (and drafter) and build an engine.

    model_path: a Hugging Face model directory (``config.json``, safetensors or a GGUF file).
    drafter_path: a ReDrafter draft-head directory, or None (plain decoding only).
    overrides: fields of :class:`EngineOptions` or :class:`SpeculationOptions` (see :func:`split_options`).
    executor_factory(model, num_slots, kv_dtype): the executor (default :class:`LocalExecutor`; the
        tensor-parallel one for ``tp_size > 1``, :func:`workers.tp.executor.tp_executor_factory`).
    spec_policy: a speculation policy to use instead of the one ``speculation`` selects for this
        compute path (a test's or benchmark's own controller).

    Raises:
        FileNotFoundError, ValueError: unreadable model or drafter, mismatched shapes, options the
            model or machine cannot honour (named).
    """
    opts, spec = split_options(options, speculation, **overrides)
    resolve_prefill_dtype(opts.prefill_dtype)  # a bad value fails before the model loads
    if opts.num_threads:
        torch.set_num_threads(opts.num_threads)
    device, dtype = torch.device(opts.device), DTYPES[opts.dtype]
    model = load_model(model_path, dtype, opts.device)
    gguf = resolve_weights(opts.weights, model_path, opts.dtype, opts.device, opts.tp_size)
    weights = use_gguf_weights(model, gguf, strict=opts.weights == "gguf") if gguf else None
    prefill = _prefill_path(model, opts.prefill_dtype, weights)
    decode = _decode_activations(model, opts, weights)
    isa = build.load() if device.type == "cpu" and opts.dtype == "float32" and build.available() else None
    if decode == "int8" and isa == "avx512":
        from workers.kernels.quant_linear import best_int8_kernel

        isa = "amx" if best_int8_kernel() == "amx" else isa  # the kernel use_int8_activations chose
    name = compute_path_name(device.type, "gguf" if weights is not None and weights.quantized else opts.dtype, isa,
                             decode == "int8")
    # only on rdserve's C kernels, whose results are the same on any thread count (torch's GEMM's
    # need not be, and a request's steps would then depend on the counts chosen)
    on_kernels = device.type == "cpu" and not name.endswith("-torch")
    threads = ThreadPolicy(torch.get_num_threads()) \
        if opts.adaptive_threads and on_kernels and opts.tp_size == 1 and torch.get_num_threads() > 1 else None
    tokenizer = load_tokenizer(model_path)
    drafter = None
    if drafter_path:  # on GGUF blocks the drafter runs on Q8_0 blocks too (workers/redrafter/quantize.py)
        drafter = load_drafter(drafter_path, model.lm_head.weight, dtype, opts.device,
                               weight_format="Q8_0" if weights is not None else "float32")
        if decode == "int8":  # its Q8_0 layers too: drafts only propose, exactness holds
            from workers.redrafter.quantize import use_int8_activations_in_drafter

            use_int8_activations_in_drafter(drafter)
    lookup = None if spec.prompt_lookup_num_tokens == 0 else PromptLookup(
        spec.prompt_lookup_min, spec.prompt_lookup_max, spec.prompt_lookup_num_tokens, spec.prompt_lookup_max_num_tokens)
    max_seq_len = min(opts.max_seq_len, model.config.max_position_embeddings)
    kv_dtype = dtype if opts.kv_cache_dtype == "auto" else KV_DTYPES[opts.kv_cache_dtype]
    conditions = step_time_conditions(str(kv_dtype).removeprefix("torch."),
                                      torch.get_num_threads() if device.type == "cpu" else None)
    selected = SelectedPolicy(spec_policy, "given") if spec_policy is not None \
        else select_policy(spec, name, opts.max_batch_size, conditions)
    log.info("speculation policy: %s (compute path %s)", selected.source, name)
    compute = ComputePath(name, weights, prefill, decode, conditions)
    kv_size = _size_cache(model.config, kv_dtype, opts, max_seq_len, selected.policy, lookup, device)
    log.info("%s", kv_size)
    blocks = BlockManager(kv_size.num_blocks, opts.tokens_per_block, opts.enable_prefix_caching)
    executor = (executor_factory or LocalExecutor)(model, blocks.num_slots - 1, kv_dtype)
    engine = Engine(model, tokenizer, drafter, executor, blocks, kv_size, selected, lookup, opts, spec, compute,
                    max_seq_len, threads)
    if selected.measure_at_start and drafter is not None:
        _seed_step_times(engine, spec.auto.start_batch_sizes)
    return engine


def _seed_step_times(engine: Engine, batch_sizes: list[int]) -> None:
    """Reseed the live goodput model's step times with a start-up measurement (its calibration is of
    another compute path or code version); a failed measurement keeps the calibration's."""
    from workers.speculation.startup import measure_seed

    costs = engine.spec_policy.costs
    seed = measure_seed(engine, costs.shapes, batch_sizes, costs.tokens_per_step)
    if seed is None:
        log.warning("start-up step-time measurement: no batch size fits this engine; starting from the "
                    "calibration's step times")
        return
    costs.reseed(seed)


def _prefill_path(model, setting: str, weights) -> str:
    """Resolve ``prefill_dtype`` and give the GGUF linears their bfloat16 weights when it is
    bfloat16; returns ``"bfloat16"`` or ``"float32"``.

    Raises:
        ValueError: ``"bfloat16"`` without GGUF-block weights.
    """
    prefill = resolve_prefill_dtype(setting)
    if prefill == "bfloat16" and weights is None:
        if setting == "bfloat16":
            raise ValueError("prefill_dtype 'bfloat16' needs the model on GGUF blocks (weights 'gguf', or "
                             "'auto' with a GGUF model); float32 weights prefill in float32")
        prefill = "float32"
    if prefill == "bfloat16":
        log.info("prefill: prompt rows of %d GGUF linears in bfloat16 (oneDNN AMX)", use_bf16_prefill(model))
    return prefill


def _decode_activations(model, opts: EngineOptions, weights) -> str:
    """Resolve ``decode_activations`` and switch the GGUF linears to int8 activations when it is
    int8; returns ``"int8"`` or ``"float32"``.

    Raises:
        ValueError: ``"int8"`` without GGUF-block weights.
    """
    setting = opts.decode_activations
    if setting == "int8" and weights is None:
        raise ValueError("decode_activations 'int8' needs the model on GGUF blocks (weights 'gguf', or 'auto' "
                         f"with a GGUF model, and tp_size 1; got weights {opts.weights!r}, tp_size {opts.tp_size})")
    if setting == "auto":  # int8 wherever some layer is on Q4_1/Q8_0 blocks (the C kernels loaded)
        setting = "int8" if weights is not None and bool(weights.quantized) else "float32"
    if setting == "int8":
        from workers.kernels.quant_linear import best_int8_kernel

        n = use_int8_activations(model)
        log.info("decode: %d GGUF linears take int8 activations (%s kernel)", n, best_int8_kernel())
    return setting


def _size_cache(cfg, dtype, opts: EngineOptions, max_seq_len: int, policy: SpecPolicy, lookup,
                device: torch.device) -> KVCacheSize:
    """Blocks for ``num_kv_blocks``, or ``kv_cache_fraction`` of free memory capped at what
    ``max_batch_size`` full-length sequences with the largest draft tree need."""
    per_token = kv_bytes_per_token(cfg, dtype, opts.tp_size)
    name = str(dtype).removeprefix("torch.")
    if opts.num_kv_blocks is not None:
        return replace(size_kv_cache(per_token, opts.tokens_per_block, num_blocks=opts.num_kv_blocks), dtype=name)
    max_tree = max((b * d for b, d in policy.shapes), default=0)
    if max_tree and lookup:
        max_tree += lookup.longest
    need_tokens = opts.max_batch_size * (max_seq_len + max_tree + opts.tokens_per_block)
    cap = -(-need_tokens // opts.tokens_per_block)
    size = size_kv_cache(per_token, opts.tokens_per_block, kv_cache_fraction=opts.kv_cache_fraction,
                         free_bytes=_free_memory_bytes(device))
    return replace(size, num_blocks=min(size.num_blocks, cap), dtype=name)


def _free_memory_bytes(device: torch.device) -> int:
    """Memory available for the KV cache now: CUDA free memory, or the OS's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")
