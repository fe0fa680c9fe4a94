"""The ``args`` of the Serve application builder (``cluster.deploy.app:app_builder``) and the config they give.

Its own module so that :mod:`cluster.deploy.app` (the builder) and :mod:`cluster.deploy.serve_config` (which writes
those args into a Serve config) share it without importing each other, and so that reading a config
and the project root does not import the application (Ray Serve, the ingress, the engine).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from cluster.config import (ConfigError, RdserveConfig, check_startable, format_validation_error, load_config,
                            parse_config)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""The checkout (or image copy) holding ``cluster/``, ``workers/`` and ``configs/``."""


class BuilderArgs(BaseModel):
    """``args`` of :func:`cluster.deploy.app.app_builder`: exactly one of ``config`` (the rdserve config as a
    mapping) and ``config_path`` (a YAML file; relative: against the project root)."""

    model_config = ConfigDict(extra="forbid")
    config: dict | None = None
    config_path: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.config is None) == (self.config_path is None):
            raise ValueError("args: give exactly one of 'config' (the rdserve config inline) and 'config_path'")
        return self


def config_from_args(args: dict) -> RdserveConfig:
    """The validated config of the builder's ``args`` (see :class:`BuilderArgs`), checked like
    ``rdserve up`` checks it (paths exist, backend, calibration), except the device: the builder runs
    on the Ray head, which may have no GPU; an engine replica checks CUDA where it is placed.

    Raises:
        ConfigError: naming the field (``args.config.engine.tp_size: ...``).
    """
    try:
        parsed = BuilderArgs.model_validate(args or {})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
    if parsed.config is not None:
        try:
            cfg = parse_config(parsed.config, PROJECT_ROOT)
        except ConfigError as err:
            raise ConfigError("args.config: " + str(err).replace("\n", "\nargs.config: ")) from None
    else:
        path = Path(parsed.config_path).expanduser()
        cfg = load_config(path if path.is_absolute() else PROJECT_ROOT / path)
    check_startable(cfg, cuda_available=True)
    return cfg
