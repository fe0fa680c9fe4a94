"""Ray Serve in the benchmark's own process, for applications measured side by side on one proxy."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench_ports import free_port

from cluster.config import RdserveConfig, load_config


def config_with_model(path: str | Path) -> RdserveConfig:
    """The config at ``path``; where it names no ``model.path``, a copy naming the default model's
    directory (pulled once here, cached), so that the replicas do not each pull it."""
    from workers.models.pull import pull_default

    cfg = load_config(path)
    if cfg.model.path is None:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": pull_default()})})
    return cfg


@contextmanager
def local_serve() -> Iterator[int]:
    """Ray (8 CPUs, no dashboard, warnings only) and Ray Serve's HTTP proxy on 127.0.0.1, with
    ``cluster.app.SERVE_ENV`` set as ``rdserve up`` sets it (values already in the environment win).
    Yields the proxy's port (an int); shuts Serve and Ray down on leaving."""
    import ray
    from ray import serve

    from cluster.app import SERVE_ENV

    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)
    port = free_port()
    ray.init(include_dashboard=False, logging_level=logging.WARNING, num_cpus=8)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()
