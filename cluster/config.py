"""The serving configuration: one YAML file, validated by pydantic.

Path rule: a relative ``model.path`` or ``drafter.path`` is resolved against the directory that holds
the YAML file (not the current working directory), so ``configs/local.yaml`` works from anywhere.
Unknown keys are errors (``extra="forbid"``), so a typo fails loudly with the field's dotted name.

``load_config`` checks the schema only; ``check_startable`` checks what a start needs on this
machine (paths exist, backend/device/tp_size supported) and is called by ``rdserve up``/``generate``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, StrictBool,
                      ValidationError, ValidationInfo, field_validator, model_validator)

from cluster.auth import ApiKeySource, parse_api_keys, resolve_keys
from cluster.k8s.settings import KubernetesConfig
from workers.kernel_name import check_kernel_name
from workers.spec_schedule import SpecSchedule

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """A configuration problem; the message names the offending field (``section.key: reason``)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _resolve(path: Path | None, info: ValidationInfo) -> Path | None:
    """Make a relative path absolute against ``info.context["base_dir"]`` (the YAML file's directory)."""
    if path is None:
        return None
    base = (info.context or {}).get("base_dir")
    path = path.expanduser()
    return (Path(base) / path).resolve() if base is not None and not path.is_absolute() else path


class ModelConfig(_Section):
    name: str = Field(DEFAULT_MODEL_NAME, min_length=1, description="model id served in the OpenAI API")
    path: Path | None = Field(None, description="Hugging Face directory; null = the default model, pulled")

    _resolve_path = field_validator("path")(_resolve)


class DrafterConfig(_Section):
    path: Path | None = Field(None, description="ReDrafter draft-head directory; null = plain decoding only")

    _resolve_path = field_validator("path")(_resolve)


class EngineConfig(_Section):
    backend: Literal["torch", "tensorrt_llm"] = "torch"
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="cpu | cuda | cuda:N")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    weights: Literal["auto", "gguf", "float32"] = Field(
        "auto", description="'gguf': serve the model's GGUF Q4_1/Q8_0 blocks as shipped (CPU, float32 activations); "
        "'float32': the dequantized weights; 'auto': gguf where the model came from a GGUF file (the default model) "
        "and the engine runs float32 on CPU with tp_size 1, else float32. With gguf the drafter's float32 weights "
        "are served as Q8_0 blocks")
    prefill_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="prompt (prefill) rows of the GGUF-block linears: 'bfloat16' on oneDNN's AMX GEMM "
        "(2-3x faster prefill, weights and activations rounded to bfloat16; decode steps and draft trees stay "
        "float32, so spec output still equals plain), 'float32' the float32 kernels; 'auto': bfloat16 where "
        "weights are gguf and the CPU has AMX bfloat16 tiles. See BENCHMARKS.md, 'Prefill in bfloat16'")
    decode_activations: Literal["auto", "float32", "int8"] = Field(
        "auto", description="activations of decode steps and draft-tree rows in the GGUF-block linears: 'int8' "
        "(per 32 values, llama.cpp's Q8_1 activations with integer dot products on AVX512-VNNI or AVX2, the same "
        "results: a tree row costs a quarter (VNNI) to two thirds (AVX2) of a float32 one; output close to, not "
        "equal to, float32's; spec output still equals plain), 'float32' (bit-identical to the dequantized "
        "model); 'auto': int8 where weights are gguf. See BENCHMARKS.md, 'Int8 activations'")
    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks per replica")
    prompt_lookup_num_tokens: int = Field(
        4, ge=0, le=16, description="a prompt-lookup beam of this many tokens joins every draft tree: it copies "
        "what followed the latest earlier occurrence of the context's last n tokens (n from prompt_lookup_max down "
        "to prompt_lookup_min), so text the answer repeats from the prompt or from itself is drafted too; "
        "verification is unchanged (lossless). 0: ReDrafter beams only (needed with backend tensorrt_llm)")
    prompt_lookup_min: int = Field(2, ge=1, le=8, description="shortest n-gram matched by the prompt-lookup beam")
    prompt_lookup_max: int = Field(3, ge=1, le=8, description="longest n-gram matched by the prompt-lookup beam")
    prompt_lookup_max_num_tokens: int | None = Field(
        None, ge=1, le=32, description="after a step that accepted the whole prompt-lookup beam, the next one is "
        "twice as long, up to this many tokens (a copied or repeating span usually goes on); back to "
        "prompt_lookup_num_tokens after any other step. null = fixed length")
    draft_search: Literal["beam", "distinct_first"] = Field(
        "distinct_first", description="how the drafter's beams are chosen: 'beam', ReDrafter's beam search (the "
        "best sequences, which often share their first token; TensorRT-LLM's), or 'distinct_first', the num_beams "
        "most likely first tokens each continued greedily (more first-token candidates per tree; on broad dev at "
        "2x2: first-token acceptance 0.64 -> 0.67). Same with num_beams 1; verification is unchanged (lossless). "
        "Backend torch only")
    num_beams: int = Field(4, ge=1, le=16, description="ReDrafter beams drafted per step")
    draft_len_per_beam: int = Field(4, ge=1, le=16, description="draft tokens per beam")
    max_seq_len: int = Field(2048, ge=16, description="context length: prompt + completion tokens; at most the "
                             "model's max_position_embeddings (checked at start; left unset, 2048 is cut to it)")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads; null = cores / serve.replicas "
                                    "(with autoscaling: cores / max_replicas, so a full machine is not oversubscribed). "
                                    "Above the cores of the machine a replica starts on, it logs a warning and "
                                    "uses the cores (more threads than cores only contend)")
    adaptive_threads: bool = Field(True, description="each engine step runs on the thread count, up to num_threads, "
                                   "that its measured step times favour (workers/thread_policy.py): when another "
                                   "process takes a core, steps move to fewer threads instead of stalling on the "
                                   "preempted one; false = always num_threads. CPU engines without tensor parallelism")
    spec_schedule: Literal["auto"] | SpecSchedule | None = Field(
        None, description="'auto' (the goodput model: shape or plain per iteration from spec_calibration's "
        "step costs and live acceptance), 'off', or rows {max_batch_size, num_beams, draft_len_per_beam} "
        "(fixed schedule by number of generation requests); null = num_beams x draft_len_per_beam at every batch size",
    )
    spec_schedule_by_kernel: dict[Annotated[str, AfterValidator(check_kernel_name)], SpecSchedule] | None = Field(
        None, description="schedules as spec_schedule (rows or 'off') by the compute path they were measured on "
        "(workers.kernel_name: e.g. gguf-avx512-int8, gguf-avx2, float32-torch); a replica takes its own path's, "
        "else spec_schedule, and router.spec_max_load follows it (its largest speculating batch size). "
        "`rdserve calibrate --write` fills the entry of the path it ran on",
    )
    spec_calibration: Path | None = Field(
        None, description="`rdserve calibrate --out` JSON (step costs by batch size and shape, tokens per step) "
        "for spec_schedule 'auto' (and serve.pools' ingress); with spec_calibration_by_kernel, the one for paths "
        "that have no entry there",
    )
    spec_calibration_by_kernel: dict[Annotated[str, AfterValidator(check_kernel_name)], Path] | None = Field(
        None, description="spec_schedule 'auto': calibration JSONs by the compute path they were measured on "
        "(workers.kernel_name); a replica reads its own path's, else spec_calibration, else decodes by its "
        "path's spec_schedule_by_kernel table (else the configured shape at batch 1 only) and logs that "
        "`rdserve calibrate` is missing. `rdserve calibrate --write` fills the entry of the path it ran on",
    )

    _resolve_calibration = field_validator("spec_calibration")(_resolve)

    @field_validator("spec_calibration_by_kernel")
    @classmethod
    def _resolve_calibrations(cls, value: dict | None, info: ValidationInfo) -> dict | None:
        return None if value is None else {k: _resolve(v, info) for k, v in value.items()}

    def calibration_for(self, kernel: str) -> Path | None:
        """The calibration JSON a replica on compute path ``kernel`` reads with spec_schedule 'auto':
        ``spec_calibration_by_kernel[kernel]``, else ``spec_calibration`` (None: neither)."""
        return (self.spec_calibration_by_kernel or {}).get(kernel, self.spec_calibration)

    def calibration_files(self) -> dict[str, Path]:
        """Every calibration file named, by the field naming it (for start checks and packaging)."""
        files = {f"engine.spec_calibration_by_kernel.{k}": v for k, v in (self.spec_calibration_by_kernel or {}).items()}
        if self.spec_calibration is not None:
            files["engine.spec_calibration"] = self.spec_calibration
        return files
    max_batch_size: int = Field(16, ge=1, description="requests decoded together (in-flight batching)")
    max_num_tokens: int = Field(2048, ge=16, description="tokens per iteration: context chunks + draft trees")
    max_prefill_chunk: int | None = Field(512, ge=1, description="context tokens of one request per iteration")
    tokens_per_block: int = Field(16, ge=1, description="paged KV cache block size")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV cache blocks; null = sized by kv_cache_fraction")
    kv_cache_fraction: float = Field(0.2, gt=0, le=1, description="share of free memory for the KV cache")


class AutoPolicyConfig(_Section):
    """The goodput model's hysteresis and estimates (``engine.spec_schedule: auto``), see
    ``cluster.spec_controller``."""

    margin: float = Field(0.05, ge=0, description="another choice must win by this fraction of tokens/s...")
    patience: int = Field(8, ge=1, description="...for this many consecutive iterations before switching")
    ema_alpha: float = Field(0.05, gt=0, le=1, description="replica tokens-per-step moving average weight")
    request_ema_alpha: float = Field(0.2, gt=0, le=1, description="per-request tokens-per-step moving average weight")
    probe_interval: int = Field(8, ge=1, description="a request decoding plain for low acceptance drafts "
                                "once every this many steps")


class RouterConfig(_Section):
    """Speculation policy, see ``cluster.router.choose_mode``.

    ``spec_max_load``: in ``auto`` mode a request is decoded speculatively when the replica's load
    (requests it holds, running or queued, counting the new one) is at most this; above it, plain.
    0 turns speculation off for ``auto`` requests.
    """

    spec_max_load: int = Field(4, ge=0, description="auto requests speculate while the replica holds at most this "
                               "many; on a replica whose kernel has an engine.spec_schedule_by_kernel entry, that "
                               "table's largest speculating batch size replaces it")
    default_mode: Literal["auto", "spec", "plain"] = "auto"
    auto: AutoPolicyConfig = Field(default_factory=lambda: AutoPolicyConfig())


class AutoscalingConfig(_Section):
    """Engine replicas scaled by load (``cluster.autoscaling``); Ray Serve applies the bounds and delays.

    The defaults suit a model that loads in tens of seconds: react to a burst within about
    ``upscale_delay_s`` + ``metrics_interval_s``, keep a warm replica through lulls of a few minutes.
    """

    min_replicas: int = Field(1, ge=1, description="never fewer; >= 1 because a cold start (model load, "
                              "tens of seconds) would land in some request's TTFT")
    max_replicas: int = Field(2, ge=1, description="never more; 2 is the smallest bound that scales at all, "
                              "raise it to what the cluster's GPUs or cores can hold")
    target_ongoing_requests: float = Field(
        8.0, gt=0, description="requests per replica (decoding, queued in its engine, or queued in Serve) the "
        "replica count aims at: ceil(total / this). 8 = half of engine.max_batch_size's default 16, so a new "
        "replica is on its way before the first one's batch is full",
    )
    upscale_delay_s: float = Field(10.0, ge=0, description="demand must stay above the current count this long "
                                   "before a replica is added; bursts shorter than this are absorbed by "
                                   "in-flight batching")
    downscale_delay_s: float = Field(300.0, ge=0, description="demand must stay below the current count this "
                                     "long before a replica is stopped; a warm replica outlives short lulls")
    metrics_interval_s: float = Field(
        2.0, gt=0, description="replicas and handles push their stats this often; Serve's default 10 s would "
        "add up to 10 s to every decision (Serve 2.60 marks the field deprecated for env vars it does not read yet)",
    )
    look_back_period_s: float = Field(30.0, gt=0, description="Serve averages each replica's stats over this "
                                      "window (time-weighted mean), smoothing single requests away")
    kv_usage_target: float = Field(0.85, gt=0, le=1, description="with requests waiting in an engine, a mean KV "
                                   "cache usage (0-1) above this adds a replica: the batch cannot grow")
    slo_ttft_ms: float | None = Field(None, gt=0, description="with requests waiting in an engine, a replica's "
                                      "TTFT p90 above this (ms) adds a replica; null = not used")
    graceful_shutdown_timeout_s: float = Field(
        600.0, gt=0, description="a replica being stopped (scale-down, redeploy) first finishes its streams, "
        "for at most this long: 600 s covers a 2048-token completion at a slow 4 tokens/s",
    )

    @field_validator("max_replicas")
    @classmethod
    def _max_at_least_min(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("min_replicas")
        if low is not None and value < low:
            raise ValueError(f"must be >= min_replicas ({low})")
        return value

    @field_validator("look_back_period_s")
    @classmethod
    def _window_longer_than_interval(cls, value: float, info: ValidationInfo) -> float:
        interval = info.data.get("metrics_interval_s")
        if interval is not None and value <= interval:
            raise ValueError(f"must be longer than metrics_interval_s ({interval} s): the window must hold "
                             "more than one report")
        return value


class PoolConfig(_Section):
    """One pool of engine replicas in two-pool mode (``serve.pools``)."""

    replicas: int = Field(1, ge=1, description="engine replicas of this pool (a fixed count; unused when "
                          "autoscaling is set)")
    autoscaling: AutoscalingConfig | None = Field(None, description="scale this pool by its load; null = "
                                                  "the fixed replicas")


class PoolsConfig(_Section):
    """Two-pool mode (``cluster.pools``): ``spec`` replicas always draft with engine.num_beams x
    engine.draft_len_per_beam (as a TensorRT-LLM ReDrafter engine, whose shape is built in); ``plain``
    replicas have no drafter. The ingress sends each request to the pool where the goodput model
    (engine.spec_calibration) expects it to decode fastest."""

    spec: PoolConfig = Field(default_factory=PoolConfig)
    plain: PoolConfig = Field(default_factory=PoolConfig)


class ServeConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    replicas: int = Field(1, ge=1, description="engine replicas, one Engine each (a fixed count; unused when "
                          "autoscaling is set)")
    autoscaling: AutoscalingConfig | None = Field(None, description="scale the engine replicas by load; "
                                                  "null = the fixed serve.replicas")
    num_cpus_per_replica: float = Field(1.0, gt=0, description="Ray logical CPUs reserved per engine replica "
                                        "(scheduling only; the engine's threads are engine.num_threads)")
    max_ongoing_requests: int = Field(
        64, ge=1, description="requests admitted to one replica at once (decoding together, or queued in its "
        "engine; they count as its load); beyond this they wait in Serve's queue",
    )
    max_queued_requests: int | None = Field(
        None, ge=1, description="requests waiting in Serve's queue before HTTP 503; null = unbounded"
    )
    pools: PoolsConfig | None = Field(None, description="two-pool mode: a speculative and a plain pool of the "
                                      "same model, each with its replicas/autoscaling (replaces replicas and "
                                      "autoscaling above); null = one pool that speculates per request")
    request_router: Literal["goodput", "pow2"] = Field(
        "goodput", description="how a request picks its replica: 'goodput' (the replica where it is expected "
        "to complete first, from each replica's load, free KV blocks, step time and tokens per step; see "
        "cluster.replica_ranking) or 'pow2' (Ray Serve's default: the shorter queue of two random replicas)",
    )
    api_keys: Annotated[list[SecretStr] | ApiKeySource | None, BeforeValidator(parse_api_keys)] = Field(
        None, description="require 'Authorization: Bearer KEY' on /v1/* (cluster.auth): a list of keys, or "
        "{env: VAR} / {file: PATH} to read them where the ingress runs; null = no authentication")
    max_request_body_bytes: int | None = Field(
        1 << 20, ge=1024, description="largest request body accepted (bytes); a larger one gets HTTP 413 before it "
        "is parsed (cluster.body_limit); null = no cap")
    request_timeout_s: float | None = Field(None, gt=0, description="a request still running after this many "
                                            "seconds is aborted: 504, or an error event in a stream; null = no limit")
    drain_timeout_s: float = Field(30.0, gt=0, description="on shutdown (SIGTERM, Ctrl-C) or when Serve stops a "
                                   "replica without autoscaling, requests in flight may finish for this long "
                                   "before they are aborted with an error")
    colocate: StrictBool | Literal["auto"] = Field(
        "auto", description="run the engine inside the ingress replica's process, so a token goes from the engine "
        "thread to the HTTP response without crossing Ray (cluster.colocated): 'auto' = when the application has "
        "exactly one engine replica (serve.replicas 1, no autoscaling, no pools, engine.tp_size 1); true = require "
        "it; false = always a separate engine deployment (EngineReplica) behind the ingress")

    def colocated(self, tp_size: int) -> bool:
        """Whether the engine runs in the ingress's process (see ``colocate``), for an engine of ``tp_size`` ranks."""
        single = self.replicas == 1 and self.autoscaling is None and self.pools is None and tp_size == 1
        return single if self.colocate == "auto" else self.colocate


class ObservabilityConfig(_Section):
    """Metrics (``cluster.observability``): recorded with Ray's metrics API, exported by Ray's metrics agent."""

    enabled: bool = Field(True, description="record rdserve's metrics (false: the engine counts nothing and "
                          "replicas record nothing; Ray's own metrics stay)")
    metrics_port: int = Field(8080, ge=1, le=65535, description="port of Ray's metrics agent (Prometheus text at "
                              "/metrics) on each node started by `rdserve up`")
    metrics_host: Literal["127.0.0.1", "0.0.0.0"] = Field(
        "127.0.0.1", description="where Ray's metrics agent listens under `rdserve up`: 127.0.0.1 keeps it and "
        "every other Ray port (GCS, raylet, workers, agents) on loopback (scrape serve.host:serve.port/metrics, "
        "which proxies it); 0.0.0.0 for a head node that Prometheus or other nodes reach, which opens all of "
        "Ray's ports on every interface too: Ray binds them together, by the node's address (cluster.local_ray)")


class RdserveConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig, description="pods of `rdserve k8s "
                                         "render` (cluster.k8s); unused by local runs")

    @model_validator(mode="after")
    def _auto_needs_calibration(self):
        eng = self.engine
        if eng.spec_schedule == "auto":
            if eng.spec_calibration is None and not eng.spec_calibration_by_kernel:
                raise ValueError("engine.spec_calibration: spec_schedule 'auto' needs the calibration JSON "
                                 "(`rdserve calibrate --out FILE`), or engine.spec_calibration_by_kernel")
            if self.drafter.path is None:
                raise ValueError("engine.spec_schedule: 'auto' needs drafter.path (nothing to speculate with)")
            both = sorted(set(eng.spec_schedule_by_kernel or {}) & set(eng.spec_calibration_by_kernel or {}))
            if both:
                raise ValueError(f"engine.spec_schedule_by_kernel.{both[0]}: not used with spec_schedule 'auto', "
                                 f"which reads engine.spec_calibration_by_kernel.{both[0]} on that path; remove one")
            if eng.spec_schedule_by_kernel and eng.spec_calibration is not None:
                raise ValueError("engine.spec_schedule_by_kernel: not used with spec_schedule 'auto' and "
                                 "engine.spec_calibration (every compute path reads a calibration); remove one of "
                                 "them, or key the calibrations by path (spec_calibration_by_kernel) so that the "
                                 "tables serve the paths without one")
        elif eng.spec_calibration_by_kernel:
            raise ValueError("engine.spec_calibration_by_kernel: only read with spec_schedule 'auto' (the goodput "
                             f"model); spec_schedule is {eng.spec_schedule!r}")
        if eng.prefill_dtype == "bfloat16" and (eng.weights == "float32" or eng.tp_size > 1):
            raise ValueError("engine.prefill_dtype: 'bfloat16' is for GGUF-block weights (engine.weights gguf/auto, "
                             "tp_size 1); float32 weights prefill in float32")
        eng = self.engine
        srv = self.serve
        if srv.colocate is True and (srv.replicas != 1 or srv.autoscaling is not None or srv.pools is not None):
            raise ValueError("serve.colocate: true runs exactly one engine replica, in the ingress's process; it "
                             "cannot go with serve.replicas above 1, serve.autoscaling or serve.pools (use 'auto')")
        if self.serve.colocate is True and eng.tp_size > 1:
            raise ValueError("serve.colocate: true is for engine.tp_size 1 (tensor-parallel replicas place their "
                             "ranks as a separate deployment); use 'auto' or false")
        if eng.decode_activations == "int8" and (eng.weights == "float32" or eng.tp_size > 1):
            raise ValueError("engine.decode_activations: 'int8' is for GGUF-block weights (engine.weights gguf/auto, "
                             "tp_size 1)")
        if eng.prompt_lookup_min > eng.prompt_lookup_max:
            raise ValueError(f"engine.prompt_lookup_min: {eng.prompt_lookup_min} is above engine.prompt_lookup_max "
                             f"{eng.prompt_lookup_max}")
        if eng.prompt_lookup_max_num_tokens is not None and eng.prompt_lookup_num_tokens == 0:
            raise ValueError("engine.prompt_lookup_max_num_tokens: set, but engine.prompt_lookup_num_tokens is 0 "
                             "(no lookup beam to grow)")
        longest = (eng.prompt_lookup_max_num_tokens or eng.prompt_lookup_num_tokens) if eng.prompt_lookup_num_tokens else 0
        if 1 + eng.num_beams * eng.draft_len_per_beam + longest > eng.max_num_tokens:
            raise ValueError(f"engine.max_num_tokens: {eng.max_num_tokens} cannot hold one draft tree of "
                             f"1 + {eng.num_beams} x {eng.draft_len_per_beam} tokens plus a {longest}-token lookup beam")
        if eng.prompt_lookup_max_num_tokens is not None and eng.prompt_lookup_max_num_tokens < eng.prompt_lookup_num_tokens:
            raise ValueError(f"engine.prompt_lookup_max_num_tokens: {eng.prompt_lookup_max_num_tokens} is below "
                             f"engine.prompt_lookup_num_tokens {eng.prompt_lookup_num_tokens}")
        if eng.draft_search != "beam" and eng.backend != "torch" and "draft_search" in eng.model_fields_set:
            raise ValueError(f"engine.draft_search: {eng.draft_search!r} needs backend torch (TensorRT-LLM drafts by "
                             "beam search); use 'beam' or leave it unset")
        if eng.prompt_lookup_num_tokens and eng.backend != "torch" and "prompt_lookup_num_tokens" in eng.model_fields_set:
            raise ValueError("engine.prompt_lookup_num_tokens: the prompt-lookup beam needs backend torch "
                             "(TensorRT-LLM's ReDrafter engine drafts its compiled beams only); set it to 0")
        if self.serve.pools is not None:
            if self.serve.autoscaling is not None:
                raise ValueError("serve.autoscaling: not used with serve.pools; set serve.pools.spec.autoscaling "
                                 "and serve.pools.plain.autoscaling")
            if self.engine.spec_schedule_by_kernel:
                raise ValueError("engine.spec_schedule_by_kernel: not used with serve.pools (the spec pool drafts "
                                 "engine.num_beams x draft_len_per_beam at every batch size); remove it")
            if self.engine.spec_schedule is not None:
                raise ValueError("engine.spec_schedule: not used with serve.pools (the spec pool drafts "
                                 "engine.num_beams x draft_len_per_beam at every batch size); leave it null")
            if self.engine.spec_calibration is None:
                raise ValueError("engine.spec_calibration: serve.pools needs the calibration JSON (the ingress "
                                 "picks a pool with the goodput model; `rdserve calibrate --out FILE`)")
            if self.drafter.path is None:
                raise ValueError("serve.pools: two-pool mode needs drafter.path for the speculative pool")
        return self


def format_validation_error(err: ValidationError) -> str:
    """One line per problem: ``dotted.field: pydantic message``."""
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]).replace(".[key]", " (key)")  # a mapping's key is what is wrong
        if not field and e["msg"].startswith("Value error, "):  # a cross-field check: its message names the field
            lines.append(e["msg"].removeprefix("Value error, "))
            continue
        lines.append(f"{field or '(top level)'}: {e['msg']}")
    return "\n".join(lines)


def parse_config(data: dict, base_dir: Path) -> RdserveConfig:
    """Validate a mapping; relative paths resolve against ``base_dir``.

    Raises:
        ConfigError: naming each offending field.
    """
    try:
        return RdserveConfig.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def load_config(path: str | Path) -> RdserveConfig:
    """Read and validate a YAML config file.

    Raises:
        ConfigError: unreadable file, invalid YAML, or invalid fields (each named).
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config file ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    try:
        return parse_config(data, path.resolve().parent)
    except ConfigError as err:
        raise ConfigError(f"{path}:\n{err}") from None


def check_startable(cfg: RdserveConfig, cuda_available: bool | None = None, calibration: bool = True) -> None:
    """What this build can start: torch backend, an available device, existing paths.

    ``cuda_available`` defaults to ``torch.cuda.is_available()``. ``calibration`` False skips reading
    ``engine.spec_calibration`` (``rdserve calibrate`` is what writes it).

    Raises:
        ConfigError: naming the field that cannot be honoured here.
    """
    try:  # keys from an environment variable or file: this machine must have them (the ingress runs here)
        resolve_keys(cfg.serve.api_keys)
    except ValueError as err:
        raise ConfigError(f"serve.api_keys: {err}") from None
    eng = cfg.engine
    if eng.backend == "tensorrt_llm":
        installed = importlib.util.find_spec("tensorrt_llm") is not None
        why = "is installed but not wired into this build yet" if installed else "is not installed here"
        raise ConfigError(
            f"engine.backend: 'tensorrt_llm' needs a CUDA GPU and the tensorrt_llm package, which {why}; "
            "use backend 'torch'"
        )
    if eng.device.startswith("cuda"):
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        if not cuda_available:
            raise ConfigError(f"engine.device: '{eng.device}' requested but no CUDA device is available")
    for field, path in (("model.path", cfg.model.path), ("drafter.path", cfg.drafter.path)):
        if path is not None and not path.is_dir():
            raise ConfigError(f"{field}: directory not found: {path}")
        if path is not None and not (path / "config.json").is_file():
            raise ConfigError(f"{field}: {path} has no config.json (not a model/drafter directory)")
    if (eng.spec_schedule == "auto" or cfg.serve.pools is not None) and calibration:
        from cluster.goodput import StepCosts

        lookup = eng.prompt_lookup_max_num_tokens or eng.prompt_lookup_num_tokens if eng.prompt_lookup_num_tokens else 0
        keys = {f"engine.spec_calibration_by_kernel.{k}": k for k in eng.spec_calibration_by_kernel or {}}
        loaded = {}
        for field, path in eng.calibration_files().items():
            try:
                costs = loaded[field] = StepCosts.load(path)
            except ValueError as err:
                raise ConfigError(f"{field}: {err}") from None
            key = keys.get(field)
            measured = json.loads(path.read_text()).get("kernel")
            if key is not None and measured is not None and measured != key:
                raise ConfigError(f"{field}: {path} was measured on compute path {measured}, not {key} (its "
                                  "step costs belong to that path); file it under its own path or re-run "
                                  "`rdserve calibrate` on a machine of this one")
            too_big = [s for s in costs.shapes if 1 + s[0] * s[1] + lookup > eng.max_num_tokens or s[0] > 16 or s[1] > 16]
            if too_big:
                raise ConfigError(f"{field}: shape {too_big[0][0]}x{too_big[0][1]} in "
                                  f"{path} is larger than the engine allows (num_beams and "
                                  f"draft_len_per_beam at most 16, a tree with its prompt-lookup beam within engine.max_num_tokens "
                                  f"{eng.max_num_tokens})")
        shape = (eng.num_beams, eng.draft_len_per_beam)
        if cfg.serve.pools is not None and shape not in loaded["engine.spec_calibration"].spec_s:
            raise ConfigError(f"engine.spec_calibration: serve.pools drafts {shape[0]}x{shape[1]} "
                              f"(engine.num_beams x draft_len_per_beam) but {eng.spec_calibration} has no step "
                              f"times for it; calibrate with --shapes including {shape[0]}x{shape[1]}")
    from workers.models.pull import default_model_dir

    model_dir = cfg.model.path or default_model_dir()  # the default model once pulled
    if (model_dir / "config.json").is_file():
        check_model_limits(eng, model_dir)


def check_model_limits(eng: EngineConfig, model_dir: Path) -> None:
    """What the model in ``model_dir`` allows (its ``config.json``): ``engine.tp_size`` divides its
    heads; a ``engine.max_seq_len`` set in the config is within its ``max_position_embeddings``
    (the engine would otherwise cut the context to them without a word).

    Raises:
        ConfigError: naming the field.
    """
    from workers.models.config import LlamaConfig

    try:
        model = LlamaConfig.from_dir(model_dir)
    except KeyError as err:
        raise ConfigError(f"model.path: {model_dir}/config.json has no {err}") from None
    except ValueError as err:  # not JSON, or a model_type this build does not run
        raise ConfigError(f"model.path: {model_dir}/config.json: {err}") from None
    if eng.tp_size > 1:
        from workers.tp.layers import check_tp_size

        try:
            check_tp_size(model, eng.tp_size)
        except ValueError as err:
            raise ConfigError(f"engine.tp_size: {err} (model {model_dir})") from None
    if "max_seq_len" in eng.model_fields_set and eng.max_seq_len > model.max_position_embeddings:
        raise ConfigError(f"engine.max_seq_len: {eng.max_seq_len} is above the model's max_position_embeddings "
                          f"{model.max_position_embeddings} (model {model_dir}); set it to at most that")
