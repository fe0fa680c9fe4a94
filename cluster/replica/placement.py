"""Where a tensor-parallel engine replica's GPUs come from: Ray reserves them, each MPI rank gets one.

An engine replica with ``engine.tp_size`` N on CUDA asks Serve for a placement group of N bundles, one
GPU each, ``STRICT_PACK`` (all on one node: the ranks talk over NCCL on that node). Serve puts the
replica actor (rank 0, the leader) in bundle 0, so bundle 0 also holds the actor's CPUs. Bundle r's
GPU is rank r's: :func:`placement_gpu_ids` asks Ray which GPU each bundle holds, and
:mod:`workers.tp.launch` pins rank r to it (``CUDA_VISIBLE_DEVICES``). The ranks are MPI processes,
not Ray actors; the placement group keeps their GPUs from being given to anything else.

Ray Serve's own LLM stack places vLLM's TP workers the same way (one ``{"GPU": 1}`` bundle per rank,
the replica's resources merged into the first bundle; ``ray.llm`` ``VLLMEngineConfig.placement_bundles``).
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.config import RdserveConfig

TP_PLACEMENT_STRATEGY = "STRICT_PACK"


def uses_gpu_placement(cfg: RdserveConfig) -> bool:
    """True when a replica needs a placement group: CUDA and ``engine.tp_size`` > 1."""
    return cfg.engine.device.startswith("cuda") and cfg.engine.tp_size > 1


def tp_bundles(tp_size: int, num_cpus: float) -> list[dict[str, float]]:
    """Placement-group bundles of one engine replica: bundle r holds rank r's GPU; bundle 0 also the
    replica actor's ``num_cpus`` (Serve schedules the actor into bundle 0, and its
    ``ray_actor_options`` must fit there).

    Returns ``[{"CPU": num_cpus, "GPU": 1}, {"GPU": 1}, ...]`` (``tp_size`` bundles).

    Raises:
        ValueError: ``tp_size`` < 1 or ``num_cpus`` < 0.
    """
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if num_cpus < 0:
        raise ValueError(f"num_cpus must be >= 0, got {num_cpus}")
    return [{"CPU": float(num_cpus), "GPU": 1.0}] + [{"GPU": 1.0} for _ in range(tp_size - 1)]


def tp_placement_options(cfg: RdserveConfig) -> dict:
    """Serve deployment options reserving the replica's GPUs: ``placement_group_bundles`` and
    ``placement_group_strategy`` for a CUDA replica with ``tp_size`` > 1, else ``{}`` (a TP1 CUDA
    replica takes its one GPU through ``ray_actor_options``; CPU ranks share the replica's CPUs)."""
    if not uses_gpu_placement(cfg):
        return {}
    return {"placement_group_bundles": tp_bundles(cfg.engine.tp_size, cfg.serve.num_cpus_per_replica),
            "placement_group_strategy": TP_PLACEMENT_STRATEGY}


def rank_gpu_ids(bundle_gpu_ids: Sequence[Sequence[str | int]]) -> list[str]:
    """Rank r's GPU from what Ray assigned in bundle r (``ray.get_gpu_ids()`` there).

    Returns one GPU id per rank (strings, as ``CUDA_VISIBLE_DEVICES`` takes them).

    Raises:
        ValueError: a bundle with other than exactly one GPU, or a GPU in two bundles.
    """
    ids = []
    for rank, gpus in enumerate(bundle_gpu_ids):
        if len(gpus) != 1:
            raise ValueError(f"placement bundle {rank} holds {len(gpus)} GPUs ({list(gpus)}); one per rank expected")
        ids.append(str(gpus[0]))
    if len(set(ids)) != len(ids):
        raise ValueError(f"placement bundles share a GPU: {ids}")
    return ids


def _gpu_ids() -> list[str]:
    import ray

    return [str(i) for i in ray.get_gpu_ids()]


def placement_gpu_ids(tp_size: int, timeout_s: float = 60.0) -> list[str]:
    """Inside an engine replica placed by :func:`tp_placement_options`: the GPU of each of its
    ``tp_size`` bundles, rank order. Bundle 0's is the actor's own; for bundles 1.. a zero-CPU task
    holding the bundle's GPU reports it (the bundle keeps the same GPU afterwards, reserved to this
    placement group).

    Raises:
        RuntimeError: not running in a placement group of ``tp_size`` bundles.
        ValueError: see :func:`rank_gpu_ids`.
    """
    import ray
    from ray.util import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = get_current_placement_group()
    if pg is None or len(pg.bundle_specs) != tp_size:
        have = "none" if pg is None else f"{len(pg.bundle_specs)} bundles"
        raise RuntimeError(f"engine.tp_size {tp_size} on CUDA needs a placement group of {tp_size} GPU bundles "
                           f"(cluster.replica.placement.tp_placement_options); this replica has {have}")
    probe = ray.remote(num_cpus=0, num_gpus=1)(_gpu_ids)
    refs = [probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
            .remote() for i in range(1, tp_size)]
    return rank_gpu_ids([_gpu_ids()] + ray.get(refs, timeout=timeout_s))
