"""The serving configuration: one YAML file, validated by pydantic; the ground floor of ``cluster/``.

Sections validate themselves (``engine`` and ``speculation`` are the workers' own option models,
:mod:`workers.engine_options` and :mod:`workers.speculation.options`, with a server's defaults); the few
rules that tie sections together are named functions in :mod:`cluster.config.rdserve`. Unknown keys
are errors (``extra="forbid"``), so a typo fails with the field's dotted name; a key that moved fails
naming its new place. ``load_config`` checks the schema only; ``check_startable`` checks what a start
needs on this machine (``rdserve up`` / ``generate`` call it).

Modules: ``base`` (error type, model/drafter), ``engine`` (engine, speculation), ``serve`` (serve,
autoscaling, pools, observability), ``keys`` (API key sources), ``kubernetes``, ``rdserve`` (the whole
config, moved keys, cross-section rules), ``load``, ``startable``.
"""

from cluster.config.base import DEFAULT_MODEL_NAME, ConfigError, DrafterConfig, ModelConfig
from cluster.config.engine import EngineConfig, SpeculationConfig, serving_defaults
from cluster.config.keys import ApiKeySource, is_masked, parse_api_keys, resolve_keys
from cluster.config.kubernetes import KubernetesConfig
from cluster.config.load import format_validation_error, load_config, parse_config
from cluster.config.rdserve import MOVED_KEYS, RdserveConfig, moved_keys
from cluster.config.serve import (AutoscalingConfig, ObservabilityConfig, PoolConfig, PoolsConfig,
                                  ServeConfig)
from cluster.config.startable import check_model_limits, check_startable

__all__ = [
    "DEFAULT_MODEL_NAME", "ConfigError", "DrafterConfig", "ModelConfig", "EngineConfig", "SpeculationConfig",
    "serving_defaults", "ApiKeySource", "is_masked", "parse_api_keys", "resolve_keys", "KubernetesConfig",
    "format_validation_error", "load_config", "parse_config", "MOVED_KEYS", "RdserveConfig", "moved_keys",
    "AutoscalingConfig", "ObservabilityConfig", "PoolConfig", "PoolsConfig", "ServeConfig", "check_model_limits",
    "check_startable",
]
