"""Step 2, compatibility: what this deployment runs on, and whether the combination is supported.

Unsupported combinations (``engine.tp_size`` > 1, the ``tensorrt_llm`` backend without a GPU build,
a CUDA device that is not there) raise ``cluster.config.ConfigError`` naming the field, through
``cluster.config.check_startable``: the same check ``rdserve up`` makes.
"""

from __future__ import annotations

import importlib.metadata
import platform

import httpx

from cluster.config import RdserveConfig, check_startable

PACKAGES = ("torch", "transformers", "ray", "rdserve")

# What the torch engine does today (workers/engine.py runs one request at a time); these arrive with
# the scheduler (in-flight batching over a paged KV cache).
ENGINE_FEATURES = {
    "in_flight_batching": "no: one request per engine step; replicas serve requests one after another",
    "paged_kv_cache": "no: one contiguous KV cache per request",
    "empty_sub_batch": "n/a: without in-flight batching there are no context/generation sub-batches",
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
                      "num_beams": eng.num_beams, "draft_len_per_beam": eng.draft_len_per_beam},
        "router": {"spec_max_load": cfg.router.spec_max_load, "default_mode": cfg.router.default_mode},
        "replicas": cfg.serve.replicas,
        "features": dict(ENGINE_FEATURES),
        "versions": package_versions(),
        "server": server_health(base_url),
    }
