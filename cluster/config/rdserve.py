"""The whole config (``RdserveConfig``), the keys that moved, and the few rules that tie sections together."""

from __future__ import annotations

from pydantic import Field, model_validator

from cluster.config.base import DrafterConfig, ModelConfig, _Section
from cluster.config.engine import EngineConfig, SpeculationConfig
from cluster.config.kubernetes import KubernetesConfig
from cluster.config.serve import ObservabilityConfig, ServeConfig


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
    if "router" in data and not data["router"]:  # `router:` left empty (null) or `router: {}`
        problems.append("router: moved to the speculation section")
    elif isinstance(data.get("router"), dict):
        problems += [f"router.{key}: the router section moved to speculation (it has no {key})"
                     for key in data["router"] if ("router", key) not in MOVED_KEYS]
    return problems


class RdserveConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig, description="the draft tree and "
                                           "when to draft (workers.speculation)")
    serve: ServeConfig = Field(default_factory=ServeConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig, description="pods of `rdserve k8s "
                                         "render` (cluster.deploy.k8s); unused by local runs")

    @model_validator(mode="before")
    @classmethod
    def _no_moved_keys(cls, data):
        problems = moved_keys(data) if isinstance(data, dict) else []
        if problems:
            raise ValueError("\n".join(problems))  # one line per key (format_validation_error)
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
