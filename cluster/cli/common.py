"""What the ``rdserve`` commands share: load a config they can start with, and fill in the default model."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console

from cluster.config import ConfigError, RdserveConfig, check_startable, load_config

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # an error is one line, however long its paths


def startable_config(path: Path, calibration: bool = True) -> RdserveConfig:
    """Load and check the config; on error print it (naming the field) and exit with code 2."""
    try:
        cfg = load_config(path)
        check_startable(cfg, calibration=calibration)
    except ConfigError as err:
        exit_config_error(err)
    return cfg


def exit_config_error(err: ConfigError) -> NoReturn:
    err_console.print(f"[red]config error[/red]: {err}", highlight=False)
    raise typer.Exit(2) from None


def with_model_dir(cfg: RdserveConfig) -> RdserveConfig:
    """Pull the default model when ``model.path`` is null (a no-op once cached)."""
    if cfg.model.path is not None:
        return cfg
    from workers.models.pull import pull_default

    with console.status(f"pulling the default model {cfg.model.name} (first run converts GGUF -> safetensors)"):
        model_dir = pull_default()
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model_dir})})
