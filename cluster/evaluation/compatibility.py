"""Step 2, compatibility: what this deployment runs on, and whether the combination is supported.

Unsupported combinations (a ``tp_size`` the model's heads cannot be split by, the ``tensorrt_llm``
backend without a GPU build, a CUDA device that is not there) raise ``cluster.config.ConfigError`` naming the field, through
``cluster.config.check_startable``: the same check ``rdserve up`` makes.
"""

from __future__ import annotations

import importlib.metadata
import platform

import httpx

from cluster.config import RdserveConfig, check_startable
from workers.speculation.schedule import schedule_text

PACKAGES = ("torch", "transformers", "ray", "rdserve")



def speculation_text(spec) -> str:
    """``speculation`` in one line: ``auto (calibration ...)``, ``off``, ``fixed 2x2`` or a table's rows."""
    if spec.policy == "auto":
        return f"auto (the goodput model; calibration {spec.calibration.name if spec.calibration else 'per compute path'})"
    if spec.policy == "table":
        return schedule_text(spec.table)
    return "off" if spec.policy == "off" else f"fixed {spec.num_beams}x{spec.draft_len_per_beam} at every batch size"


def engine_features(cfg: RdserveConfig) -> dict[str, str]:
    """What the torch engine does with this config (``workers/engine.py``)."""
    eng = cfg.engine
    kv = f"{eng.num_kv_blocks} blocks" if eng.num_kv_blocks else f"{eng.kv_cache_fraction:.0%} of free memory"
    return {
        "in_flight_batching": f"yes: up to {eng.max_batch_size} requests, {eng.max_num_tokens} tokens per "
                              f"iteration, prefill chunks of {eng.max_prefill_chunk or eng.max_num_tokens}",
        "paged_kv_cache": f"yes: blocks of {eng.tokens_per_block} tokens, {kv}, values in "
                          f"{eng.dtype if eng.kv_cache_dtype == 'auto' else eng.kv_cache_dtype}",
        "empty_sub_batch": "yes: iterations with only context or only generation requests",
        "speculation_policy": speculation_text(cfg.speculation),
        **({"speculation_by_compute_path": "; ".join(
            f"{k}: {schedule_text(v.table) if v.table is not None else f'calibration {v.calibration.name}'}"
            for k, v in cfg.speculation.by_compute_path.items())
            + " (a replica on one of these compute paths takes its entry; the server's /health names its path)"}
           if cfg.speculation.by_compute_path else {}),
        "tensor_parallel": f"tp_size {eng.tp_size} over MPI" if eng.tp_size > 1 else "tp_size 1",
    }


def package_versions() -> dict[str, str | None]:
    """Installed versions of the serving stack (None = not installed) plus Python's."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def server_health(base_url: str | None, timeout_s: float = 10.0) -> dict | None:
    """``GET /health`` of a running cluster (model, speculative_available, ...); None if unreachable."""
    if base_url is None:
        return None
    try:
        return httpx.get(f"{base_url.rstrip('/')}/health", timeout=timeout_s).json()
    except (httpx.HTTPError, ValueError):
        return None


def check_compatibility(cfg: RdserveConfig, base_url: str | None = None,
                        cuda_available: bool | None = None) -> dict:
    """Describe the deployment and check it is startable.

    Raises:
        cluster.config.ConfigError: an unsupported combination, naming the field.
    """
    check_startable(cfg, cuda_available)
    eng = cfg.engine
    return {
        "backend": eng.backend,
        "device": eng.device,
        "dtype": eng.dtype,
        "tp_size": eng.tp_size,
        "max_seq_len": eng.max_seq_len,
        "redrafter": {"drafter": str(cfg.drafter.path) if cfg.drafter.path else None,
                      "num_beams": cfg.speculation.num_beams, "draft_len_per_beam": cfg.speculation.draft_len_per_beam},
        "speculation": {"policy": cfg.speculation.policy, "spec_max_load": cfg.speculation.spec_max_load,
                        "default_mode": cfg.speculation.default_mode},
        "replicas": cfg.serve.replicas,
        "features": engine_features(cfg),
        "versions": package_versions(),
        "server": server_health(base_url),
    }
