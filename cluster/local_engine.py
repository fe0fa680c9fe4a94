"""The ``Engine`` a config describes: what each replica (and ``rdserve generate``) runs."""

from __future__ import annotations

import os

from cluster.config import RdserveConfig


def build_engine(cfg: RdserveConfig):
    """Load model and drafter per ``cfg``; a null ``model.path`` pulls the default model (cached).

    A null ``engine.num_threads`` shares the machine's cores among the replicas (Ray would
    otherwise give each actor ``OMP_NUM_THREADS=1``).

    ``engine.tp_size > 1`` runs the base model on that many MPI ranks (``workers.tp``).

    Returns a ``workers.engine.Engine``.
    """
    from workers.engine import Engine, EngineOptions
    from workers.models.pull import pull_default

    eng = cfg.engine
    model_dir = cfg.model.path or pull_default()
    drafter_dir = cfg.drafter.path
    options = EngineOptions(
        device=eng.device, dtype=eng.dtype, num_beams=eng.num_beams, draft_len_per_beam=eng.draft_len_per_beam,
        spec_schedule=eng.spec_schedule, max_seq_len=eng.max_seq_len, max_batch_size=eng.max_batch_size,
        max_num_tokens=eng.max_num_tokens, max_prefill_chunk=eng.max_prefill_chunk,
        tokens_per_block=eng.tokens_per_block, num_kv_blocks=eng.num_kv_blocks,
        kv_cache_fraction=eng.kv_cache_fraction,
        num_threads=eng.num_threads or max(1, (os.cpu_count() or 1) // cfg.serve.replicas),
    )
    factory = None
    if eng.tp_size > 1:
        from workers.tp.executor import tp_executor_factory

        factory = tp_executor_factory(str(model_dir), eng.tp_size, options.num_threads)
    return Engine(str(model_dir), str(drafter_dir) if drafter_dir else None, options, executor_factory=factory,
                  tp_size=eng.tp_size)
