"""The serving configuration: one YAML file, validated by pydantic.

Path rule: a relative ``model.path`` or ``drafter.path`` is resolved against the directory that holds
the YAML file (not the current working directory), so ``configs/local.yaml`` works from anywhere.
Unknown keys are errors (``extra="forbid"``), so a typo fails loudly with the field's dotted name.

``load_config`` checks the schema only; ``check_startable`` checks what a start needs on this
machine (paths exist, backend/device/tp_size supported) and is called by ``rdserve up``/``generate``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, StrictBool,
                      ValidationError, ValidationInfo, field_validator, model_validator)

from pydantic.fields import FieldInfo

from cluster.auth import ApiKeySource, parse_api_keys, resolve_keys
from cluster.k8s.settings import KubernetesConfig
from workers.engine_options import EngineOptions
from workers.speculation.options import SpeculationOptions
from workers.speculation.shape import DraftShape

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


def serving_defaults(base: type[BaseModel], name: str, **defaults) -> type[BaseModel]:
    """``base`` (defined in ``workers``) as a config section: unknown keys are errors, and the fields
    in ``defaults`` start at the value a server wants (``field=value``, or ``field=(value,
    description)`` where the meaning of the default differs). Everything else is ``base``'s."""
    namespace: dict = {"__annotations__": {}, "__doc__": base.__doc__, "model_config": ConfigDict(extra="forbid")}
    for field, value in defaults.items():
        value, description = value if isinstance(value, tuple) else (value, None)
        info = base.model_fields[field]
        namespace["__annotations__"][field] = info.annotation
        namespace[field] = FieldInfo.merge_field_infos(info, default=value, **(
            {"description": description} if description else {}))
    return type(name, (base,), namespace)


_Engine = serving_defaults(
    EngineOptions, "_Engine", decode_activations="auto", adaptive_threads=True,
    num_threads=(None, "torch intra-op threads; null = cores / serve.replicas (with autoscaling: cores / "
                 "max_replicas, so a full machine is not oversubscribed). Above the cores of the machine a replica "
                 "starts on, it logs a warning and uses the cores (more threads than cores only contend)"))


class EngineConfig(_Engine):
    """The engine section: :class:`workers.engine_options.EngineOptions` (fields and descriptions
    there) with a server's defaults, and the backend."""

    backend: Literal["torch", "tensorrt_llm"] = Field("torch", description="'torch': rdserve's engine; "
                                                      "'tensorrt_llm': TensorRT-LLM's ReDrafter engines (not wired "
                                                      "into this build yet)")


_Speculation = serving_defaults(SpeculationOptions, "_Speculation", num_beams=4, draft_len_per_beam=4,
                                prompt_lookup_num_tokens=4)


class SpeculationConfig(_Speculation):
    """The speculation section: :class:`workers.speculation.options.SpeculationOptions` (the draft
    tree and the engine's policy) with a server's defaults, and the per-request mode
    (:func:`cluster.router.choose_mode`). Relative calibration paths resolve against the YAML's folder.

    ``spec_max_load``: under a policy that is not live (fixed, table, off), an ``auto`` request is
    decoded speculatively when the replica's load (requests it holds, running or queued, counting the
    new one) is at most this; above it, plain. 0 turns speculation off for ``auto`` requests.
    """

    default_mode: Literal["auto", "spec", "plain"] = Field(
        "auto", description="a request's mode when it names none (body extension rdserve.mode): 'auto' follows "
        "the policy and spec_max_load, 'spec' and 'plain' force one")
    spec_max_load: int = Field(4, ge=0, description="auto requests speculate while the replica holds at most this "
                               "many (policy fixed/table/off); on a replica whose compute path has a "
                               "by_compute_path table, that table's largest speculating batch size replaces it")

    _resolve_calibration = field_validator("calibration")(_resolve)

    @field_validator("by_compute_path")
    @classmethod
    def _resolve_path_calibrations(cls, value: dict | None, info: ValidationInfo) -> dict | None:
        if value is None:
            return None
        return {k: v if v.calibration is None else v.model_copy(update={"calibration": _resolve(v.calibration, info)})
                for k, v in value.items()}


MOVED_KEYS = {
    ("engine", "num_beams"): "speculation.num_beams",
    ("engine", "draft_len_per_beam"): "speculation.draft_len_per_beam",
    ("engine", "spec_schedule"): "speculation.policy ('fixed', 'table' with speculation.table, 'auto', 'off')",
    ("engine", "spec_schedule_by_kernel"): "speculation.by_compute_path.NAME.table",
    ("engine", "spec_calibration"): "speculation.calibration (with speculation.policy 'auto')",
    ("engine", "spec_calibration_by_kernel"): "speculation.by_compute_path.NAME.calibration",
    ("engine", "draft_search"): "speculation.draft_search",
    ("engine", "prompt_lookup_num_tokens"): "speculation.prompt_lookup_num_tokens",
    ("engine", "prompt_lookup_min"): "speculation.prompt_lookup_min",
    ("engine", "prompt_lookup_max"): "speculation.prompt_lookup_max",
    ("engine", "prompt_lookup_max_num_tokens"): "speculation.prompt_lookup_max_num_tokens",
    ("router", "spec_max_load"): "speculation.spec_max_load",
    ("router", "default_mode"): "speculation.default_mode",
    ("router", "auto"): "speculation.auto",
}
"""Keys of older configs and where they live now: a config that still uses one fails at start naming both."""


def moved_keys(data: dict) -> list[str]:
    """One line per key of ``data`` (a config mapping) that has moved, naming its new place."""
    problems = []
    for (section, key), place in MOVED_KEYS.items():
        if isinstance(data.get(section), dict) and key in data[section]:
            problems.append(f"{section}.{key}: moved to {place}")
    if isinstance(data.get("router"), dict) and not data["router"]:
        problems.append("router: moved to the speculation section")
    return problems


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
    """Two-pool mode (``cluster.pools``): ``spec`` replicas always draft with speculation.num_beams x
    speculation.draft_len_per_beam (as a TensorRT-LLM ReDrafter engine, whose shape is built in); ``plain``
    replicas have no drafter. The ingress sends each request to the pool where the goodput model
    (speculation.calibration) expects it to decode fastest."""

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
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig, description="the draft tree and "
                                           "when to draft (workers.speculation)")
    serve: ServeConfig = Field(default_factory=ServeConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig, description="pods of `rdserve k8s "
                                         "render` (cluster.k8s); unused by local runs")

    @model_validator(mode="before")
    @classmethod
    def _no_moved_keys(cls, data):
        problems = moved_keys(data) if isinstance(data, dict) else []
        if problems:
            raise ValueError("; ".join(problems))
        return data

    @model_validator(mode="after")
    def _cross_section_rules(self):
        """Rules that tie two sections together, each named for what it checks (every section
        checks its own fields itself)."""
        for rule in (_auto_needs_a_drafter, _colocate_fits_serving, _tree_fits_an_iteration,
                     _backend_drafts_this_way, _pools_speculate_fixed, _calibration_is_read):
            rule(self)
        return self


def _auto_needs_a_drafter(cfg: RdserveConfig) -> None:
    if cfg.speculation.policy == "auto" and cfg.drafter.path is None:
        raise ValueError("speculation.policy: 'auto' needs drafter.path (nothing to speculate with)")


def _colocate_fits_serving(cfg: RdserveConfig) -> None:
    srv = cfg.serve
    if srv.colocate is True and (srv.replicas != 1 or srv.autoscaling is not None or srv.pools is not None):
        raise ValueError("serve.colocate: true runs exactly one engine replica, in the ingress's process; it "
                         "cannot go with serve.replicas above 1, serve.autoscaling or serve.pools (use 'auto')")
    if srv.colocate is True and cfg.engine.tp_size > 1:
        raise ValueError("serve.colocate: true is for engine.tp_size 1 (tensor-parallel replicas place their "
                         "ranks as a separate deployment); use 'auto' or false")


def _tree_fits_an_iteration(cfg: RdserveConfig) -> None:
    spec, eng = cfg.speculation, cfg.engine
    if 1 + spec.num_beams * spec.draft_len_per_beam + spec.longest_lookup > eng.max_num_tokens:
        raise ValueError(f"engine.max_num_tokens: {eng.max_num_tokens} cannot hold one draft tree of 1 + "
                         f"{spec.num_beams} x {spec.draft_len_per_beam} tokens plus a {spec.longest_lookup}-token "
                         "lookup beam")


def _backend_drafts_this_way(cfg: RdserveConfig) -> None:
    spec = cfg.speculation
    if cfg.engine.backend == "torch":
        return
    if spec.draft_search != "beam" and "draft_search" in spec.model_fields_set:
        raise ValueError(f"speculation.draft_search: {spec.draft_search!r} needs engine.backend torch (TensorRT-LLM "
                         "drafts by beam search); use 'beam' or leave it unset")
    if spec.prompt_lookup_num_tokens and "prompt_lookup_num_tokens" in spec.model_fields_set:
        raise ValueError("speculation.prompt_lookup_num_tokens: the prompt-lookup beam needs engine.backend torch "
                         "(TensorRT-LLM's ReDrafter engine drafts its compiled beams only); set it to 0")


def _pools_speculate_fixed(cfg: RdserveConfig) -> None:
    if cfg.serve.pools is None:
        return
    spec = cfg.speculation
    if cfg.serve.autoscaling is not None:
        raise ValueError("serve.autoscaling: not used with serve.pools; set serve.pools.spec.autoscaling "
                         "and serve.pools.plain.autoscaling")
    if spec.policy != "fixed" or spec.by_compute_path:
        raise ValueError("speculation.policy: serve.pools needs 'fixed' without by_compute_path (the spec pool drafts "
                         "speculation.num_beams x draft_len_per_beam at every batch size)")
    if spec.calibration is None:
        raise ValueError("speculation.calibration: serve.pools needs the calibration JSON (the ingress picks a pool "
                         "with the goodput model; `rdserve calibrate --out FILE`)")
    if cfg.drafter.path is None:
        raise ValueError("serve.pools: two-pool mode needs drafter.path for the speculative pool")


def _calibration_is_read(cfg: RdserveConfig) -> None:
    spec = cfg.speculation
    if spec.calibration is not None and spec.policy != "auto" and cfg.serve.pools is None:
        raise ValueError(f"speculation.calibration: only read with policy 'auto' or serve.pools (policy is "
                         f"{spec.policy!r})")


def format_validation_error(err: ValidationError) -> str:
    """One line per problem: ``dotted.field: pydantic message``."""
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]).replace(".[key]", " (key)")  # a mapping's key is what is wrong
        own = e["msg"].removeprefix("Value error, ")
        if own != e["msg"] and (not field or own.startswith(field + ".")):  # a section's or cross-section check:
            lines.append(own)                                                # its message names the field
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
    the calibration files (``rdserve calibrate`` is what writes them).

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
    if calibration:
        _check_calibrations(cfg)
    from workers.models.pull import default_model_dir

    model_dir = cfg.model.path or default_model_dir()  # the default model once pulled
    if (model_dir / "config.json").is_file():
        check_model_limits(eng, model_dir)


def _check_calibrations(cfg: RdserveConfig) -> None:
    """Every calibration file named is readable, was measured on the compute path it is filed under,
    holds only trees the engine allows, and (two-pool mode) times the spec pool's shape.

    Raises:
        ConfigError: naming the field.
    """
    from workers.speculation.goodput import StepCosts
    from workers.speculation.policy import measured_on

    spec, max_num_tokens = cfg.speculation, cfg.engine.max_num_tokens
    loaded = {}
    for field, path in spec.calibration_files().items():
        try:
            costs = loaded[field] = StepCosts.load(path)
        except ValueError as err:
            raise ConfigError(f"{field}: {err}") from None
        key = field.split(".")[2] if field.startswith("speculation.by_compute_path.") else None
        measured, _ = measured_on(path)
        if key is not None and measured is not None and measured != key:
            raise ConfigError(f"{field}: {path} was measured on compute path {measured}, not {key} (its "
                              "step costs belong to that path); file it under its own path or re-run "
                              "`rdserve calibrate` on a machine of this one")
        too_big = [s for s in costs.shapes
                   if 1 + s.size + spec.longest_lookup > max_num_tokens or s.num_beams > 16 or s.draft_len_per_beam > 16]
        if too_big:
            raise ConfigError(f"{field}: shape {too_big[0]} in {path} is larger than the engine allows (num_beams and "
                              "draft_len_per_beam at most 16, a tree with its prompt-lookup beam within "
                              f"engine.max_num_tokens {max_num_tokens})")
    shape = DraftShape(spec.num_beams, spec.draft_len_per_beam)
    if cfg.serve.pools is not None and shape not in loaded["speculation.calibration"].spec_s:
        raise ConfigError(f"speculation.calibration: serve.pools drafts {shape} (speculation.num_beams x "
                          f"draft_len_per_beam) but {spec.calibration} has no step times for it; calibrate with "
                          f"--shapes including {shape}")


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
