"""What a start needs on this machine (``check_startable``): paths, backend, device, calibration files, the model's limits.

``load_config`` checks the schema only; ``rdserve up`` / ``generate`` / ``eval`` call this too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cluster.config.base import ConfigError
from cluster.config.engine import EngineConfig
from cluster.config.keys import resolve_keys
from cluster.config.rdserve import RdserveConfig
from workers.speculation.shape import DraftShape


def check_startable(cfg: RdserveConfig, cuda_available: bool | None = None, calibration: bool = True) -> None:
    """What this build can start: torch backend, an available device, existing paths.

    ``cuda_available`` defaults to ``torch.cuda.is_available()``. ``calibration`` False skips reading
    the calibration files (``rdserve calibrate`` is what writes them).

    Raises:
        ConfigError: naming the field that cannot be honoured here.
    """
    try:  # keys from an environment variable or file: this machine must have them (the ingress runs here)
        resolve_keys(cfg.serve.api_keys)
    except ValueError as err:
        raise ConfigError(f"serve.api_keys: {err}") from None
    eng = cfg.engine
    if eng.backend == "tensorrt_llm":
        installed = importlib.util.find_spec("tensorrt_llm") is not None
        why = "is installed but not wired into this build yet" if installed else "is not installed here"
        raise ConfigError(
            f"engine.backend: 'tensorrt_llm' needs a CUDA GPU and the tensorrt_llm package, which {why}; "
            "use backend 'torch'"
        )
    if eng.device.startswith("cuda"):
        if cuda_available is None:
            import torch

            cuda_available = torch.cuda.is_available()
        if not cuda_available:
            raise ConfigError(f"engine.device: '{eng.device}' requested but no CUDA device is available")
    for field, path in (("model.path", cfg.model.path), ("drafter.path", cfg.drafter.path)):
        if path is not None and not path.is_dir():
            raise ConfigError(f"{field}: directory not found: {path}")
        if path is not None and not (path / "config.json").is_file():
            raise ConfigError(f"{field}: {path} has no config.json (not a model/drafter directory)")
    if calibration:
        _check_calibrations(cfg)
    from workers.models.pull import default_model_dir

    model_dir = cfg.model.path or default_model_dir()  # the default model once pulled
    if (model_dir / "config.json").is_file():
        check_model_limits(eng, model_dir)


def _check_calibrations(cfg: RdserveConfig) -> None:
    """Every calibration file named is readable, was measured on the compute path it is filed under,
    holds only trees the engine allows, and (two-pool mode) times the spec pool's shape.

    Raises:
        ConfigError: naming the field.
    """
    from workers.speculation.goodput import StepCosts
    from workers.speculation.policy import measured_on

    spec, max_num_tokens = cfg.speculation, cfg.engine.max_num_tokens
    loaded = {}
    for field, path in spec.calibration_files().items():
        try:
            costs = loaded[field] = StepCosts.load(path)
        except ValueError as err:
            raise ConfigError(f"{field}: {err}") from None
        key = field.split(".")[2] if field.startswith("speculation.by_compute_path.") else None
        measured, _ = measured_on(path)
        if key is not None and measured is not None and measured != key:
            raise ConfigError(f"{field}: {path} was measured on compute path {measured}, not {key} (its "
                              "step costs belong to that path); file it under its own path or re-run "
                              "`rdserve calibrate` on a machine of this one")
        too_big = [s for s in costs.shapes
                   if 1 + s.size + spec.longest_lookup > max_num_tokens or s.num_beams > 16 or s.draft_len_per_beam > 16]
        if too_big:
            raise ConfigError(f"{field}: shape {too_big[0]} in {path} is larger than the engine allows (num_beams and "
                              "draft_len_per_beam at most 16, a tree with its prompt-lookup beam within "
                              f"engine.max_num_tokens {max_num_tokens})")
    shape = DraftShape(spec.num_beams, spec.draft_len_per_beam)
    if cfg.serve.pools is not None and shape not in loaded["speculation.calibration"].spec_s:
        raise ConfigError(f"speculation.calibration: serve.pools drafts {shape} (speculation.num_beams x "
                          f"draft_len_per_beam) but {spec.calibration} has no step times for it; calibrate with "
                          f"--shapes including {shape}")


def check_model_limits(eng: EngineConfig, model_dir: Path) -> None:
    """What the model in ``model_dir`` allows (its ``config.json``): ``engine.tp_size`` divides its
    heads; a ``engine.max_seq_len`` set in the config is within its ``max_position_embeddings``
    (the engine would otherwise cut the context to them without a word).

    Raises:
        ConfigError: naming the field.
    """
    from workers.models.config import LlamaConfig

    try:
        model = LlamaConfig.from_dir(model_dir)
    except KeyError as err:
        raise ConfigError(f"model.path: {model_dir}/config.json has no {err}") from None
    except ValueError as err:  # not JSON, or a model_type this build does not run
        raise ConfigError(f"model.path: {model_dir}/config.json: {err}") from None
    if eng.tp_size > 1:
        from workers.tp.layers import check_tp_size

        try:
            check_tp_size(model, eng.tp_size)
        except ValueError as err:
            raise ConfigError(f"engine.tp_size: {err} (model {model_dir})") from None
    if "max_seq_len" in eng.model_fields_set and eng.max_seq_len > model.max_position_embeddings:
        raise ConfigError(f"engine.max_seq_len: {eng.max_seq_len} is above the model's max_position_embeddings "
                          f"{model.max_position_embeddings} (model {model_dir}); set it to at most that")
