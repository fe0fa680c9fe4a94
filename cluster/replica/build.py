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
    otherwise give each actor ``OMP_NUM_THREADS=1``). ``engine.tp_size > 1`` runs the base model on
    that many MPI ranks (``workers.tp``); on CUDA, ``tp_gpus`` pins rank r to GPU ``tp_gpus[r]``
    (``cluster.replica.placement.placement_gpu_ids`` in a replica). The engine picks its speculation policy
    for the compute path it runs on (``workers.speculation.policy.select_policy``).

    Returns a ``workers.engine.Engine``.

    Raises:
        ConfigError: the model does not allow ``engine.tp_size`` or ``engine.max_seq_len``.
    """
    from workers.engine_builder import load_engine
    from workers.models.pull import pull_default

    eng = cfg.engine
    model_dir = cfg.model.path or pull_default()
    check_model_limits(eng, Path(model_dir))
    threads = num_threads(cfg)
    factory = None
    if eng.tp_size > 1:
        from workers.tp.executor import tp_executor_factory

        factory = tp_executor_factory(str(model_dir), eng.tp_size, threads, tp_gpus)
    drafter_dir = cfg.drafter.path
    return load_engine(str(model_dir), str(drafter_dir) if drafter_dir else None, eng, cfg.speculation,
                       executor_factory=factory, num_threads=threads)


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
