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


def absolute_paths(data: dict, base: Path) -> dict:
    """A config mapping (as read from YAML) with its relative file paths made absolute against
    ``base`` (the directory of the file it came from), so that a copy written elsewhere still finds
    the model, drafter and calibration files. Changes ``data`` in place and returns it."""
    def fix(value):
        return value if value is None or Path(value).expanduser().is_absolute() else str((base / value).resolve())

    for section, key in (("model", "path"), ("drafter", "path"), ("speculation", "calibration")):
        if (data.get(section) or {}).get(key) is not None:
            data[section][key] = fix(data[section][key])
    for entry in ((data.get("speculation") or {}).get("by_compute_path") or {}).values():
        if isinstance(entry, dict) and entry.get("calibration") is not None:
            entry["calibration"] = fix(entry["calibration"])
    return data


@contextmanager
def local_serve() -> Iterator[int]:
    """Ray (8 CPUs, no dashboard, warnings only) and Ray Serve's HTTP proxy on 127.0.0.1, with
    ``cluster.deploy.app.SERVE_ENV`` set as ``rdserve up`` sets it (values already in the environment win).
    Yields the proxy's port (an int); shuts Serve and Ray down on leaving."""
    import ray
    from ray import serve

    from cluster.deploy.app import SERVE_ENV

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
