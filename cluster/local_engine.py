"""The ``Engine`` a config describes: what each replica (and ``rdserve generate``) runs."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from cluster.config import RdserveConfig, check_model_limits

log = logging.getLogger(__name__)


def build_engine(cfg: RdserveConfig, tp_gpus: list[str] | None = None):
    """Load model and drafter per ``cfg``; a null ``model.path`` pulls the default model (cached).

    A null ``engine.num_threads`` shares the machine's cores among the replicas (Ray would
    otherwise give each actor ``OMP_NUM_THREADS=1``).

    ``engine.tp_size > 1`` runs the base model on that many MPI ranks (``workers.tp``); on CUDA,
    ``tp_gpus`` pins rank r to GPU ``tp_gpus[r]`` (``cluster.placement.placement_gpu_ids`` in a replica).
    ``engine.spec_schedule: auto`` gives the engine the live goodput model (:func:`spec_controller`)
    of the compute path it runs on.

    Returns a ``workers.engine.Engine``.

    Raises:
        ConfigError: the model does not allow ``engine.tp_size`` or ``engine.max_seq_len``.
    """
    from workers.engine import Engine, EngineOptions
    from workers.models.pull import pull_default

    eng = cfg.engine
    model_dir = cfg.model.path or pull_default()
    check_model_limits(eng, Path(model_dir))
    drafter_dir = cfg.drafter.path
    options = EngineOptions(
        device=eng.device, dtype=eng.dtype, num_beams=eng.num_beams, draft_len_per_beam=eng.draft_len_per_beam,
        spec_schedule=eng.spec_schedule, spec_schedule_by_kernel=eng.spec_schedule_by_kernel,
        max_seq_len=eng.max_seq_len, max_batch_size=eng.max_batch_size,
        max_num_tokens=eng.max_num_tokens, max_prefill_chunk=eng.max_prefill_chunk,
        tokens_per_block=eng.tokens_per_block, num_kv_blocks=eng.num_kv_blocks,
        kv_cache_fraction=eng.kv_cache_fraction,
        weights=eng.weights,
        prefill_dtype=eng.prefill_dtype, decode_activations=eng.decode_activations,
        prompt_lookup_num_tokens=eng.prompt_lookup_num_tokens, prompt_lookup_min=eng.prompt_lookup_min,
        prompt_lookup_max=eng.prompt_lookup_max, prompt_lookup_max_num_tokens=eng.prompt_lookup_max_num_tokens,
        draft_search=eng.draft_search,
        num_threads=num_threads(cfg), adaptive_threads=eng.adaptive_threads,
    )
    factory = policy_for_kernel = None
    if eng.spec_schedule == "auto":
        policy_for_kernel = lambda kernel: spec_controller(cfg, kernel)  # noqa: E731
    if eng.tp_size > 1:
        from workers.tp.executor import tp_executor_factory

        factory = tp_executor_factory(str(model_dir), eng.tp_size, options.num_threads, tp_gpus)
    engine = Engine(str(model_dir), str(drafter_dir) if drafter_dir else None, options, executor_factory=factory,
                    spec_policy_for_kernel=policy_for_kernel, tp_size=eng.tp_size)
    if eng.spec_schedule == "auto" and eng.calibration_for(engine.kernel) is not None:
        field = f"engine.spec_calibration_by_kernel.{engine.kernel}" if engine.kernel in (
            eng.spec_calibration_by_kernel or {}) else "engine.spec_calibration"
        _warn_if_measured_elsewhere(eng.calibration_for(engine.kernel), engine.kernel, field, eng.draft_search)
    return engine


def _warn_if_measured_elsewhere(calibration, kernel: str, field: str = "engine.spec_calibration",
                               draft_search: str | None = None) -> None:
    """Log a warning when the calibration file says it was measured on another compute path (its
    step costs, and so the goodput model's choices, then belong to that path), or with another
    ``engine.draft_search`` (its tokens per step then belong to that search)."""
    import json

    try:
        data = json.loads(open(calibration).read())
        measured, searched = data.get("kernel"), data.get("draft_search")
    except (OSError, ValueError, AttributeError):
        return  # unreadable files are reported by StepCosts.load
    if measured is not None and measured != kernel:
        log.warning("%s %s was measured on kernel %s, this engine runs on %s: its step costs may not "
                    "hold here; run `rdserve calibrate` on this machine", field, calibration, measured, kernel)
    if draft_search is not None and searched is not None and searched != draft_search:
        log.warning("%s %s was measured with engine.draft_search %s, this engine drafts with %s: its tokens "
                    "per step may not hold; run `rdserve calibrate` with this config", field, calibration,
                    searched, draft_search)


def num_threads(cfg: RdserveConfig) -> int:
    """torch intra-op threads of one engine: ``engine.num_threads`` (at most this machine's cores; a
    warning says when it is cut), or this machine's cores shared among the most replicas it may run
    (``serve.replicas``, or ``serve.autoscaling.max_replicas``)."""
    cores = os.cpu_count() or 1
    if cfg.engine.num_threads is not None and cfg.engine.num_threads > cores:
        log.warning("engine.num_threads %d is above this machine's %d CPUs (os.cpu_count); using %d: more threads "
                    "than cores only contend", cfg.engine.num_threads, cores, cores)
        return cores
    if cfg.engine.num_threads is not None:
        return cfg.engine.num_threads
    replicas = cfg.serve.autoscaling.max_replicas if cfg.serve.autoscaling else cfg.serve.replicas
    return max(1, cores // replicas)


def spec_controller(cfg: RdserveConfig, kernel: str | None = None):
    """The live goodput model for ``engine.spec_schedule: auto`` (``cluster.spec_controller``) on
    compute path ``kernel`` (its ``engine.spec_calibration_by_kernel`` entry, else
    ``engine.spec_calibration``); None when neither names a file for it.

    Raises:
        ValueError: the calibration file is unusable (named).
    """
    from cluster.goodput import StepCosts
    from cluster.spec_controller import ControllerSettings, SpecController

    auto = cfg.router.auto
    settings = ControllerSettings(margin=auto.margin, patience=auto.patience, ema_alpha=auto.ema_alpha,
                                  request_ema_alpha=auto.request_ema_alpha, probe_interval=auto.probe_interval)
    path = cfg.engine.calibration_for(kernel) if kernel is not None else cfg.engine.spec_calibration
    if path is None:
        return None
    return SpecController(StepCosts.load(path), settings)
