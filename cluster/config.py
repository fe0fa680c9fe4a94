"""The serving configuration: one YAML file, validated by pydantic.

Path rule: a relative ``model.path`` or ``drafter.path`` is resolved against the directory that holds
the YAML file (not the current working directory), so ``configs/local.yaml`` works from anywhere.
Unknown keys are errors (``extra="forbid"``), so a typo fails loudly with the field's dotted name.

``load_config`` checks the schema only; ``check_startable`` checks what a start needs on this
machine (paths exist, backend/device/tp_size supported) and is called by ``rdserve up``/``generate``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from workers.spec_schedule import SpecSchedule

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """A configuration problem; the message names the offending field (``section.key: reason``)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _resolve(path: Path | None, info: ValidationInfo) -> Path | None:
    """Make a relative path absolute against ``info.context["base_dir"]`` (the YAML file's directory)."""
    if path is None:
        return None
    base = (info.context or {}).get("base_dir")
    path = path.expanduser()
    return (Path(base) / path).resolve() if base is not None and not path.is_absolute() else path


class ModelConfig(_Section):
    name: str = Field(DEFAULT_MODEL_NAME, min_length=1, description="model id served in the OpenAI API")
    path: Path | None = Field(None, description="Hugging Face directory; null = the default model, pulled")

    _resolve_path = field_validator("path")(_resolve)


class DrafterConfig(_Section):
    path: Path | None = Field(None, description="ReDrafter draft-head directory; null = plain decoding only")

    _resolve_path = field_validator("path")(_resolve)


class EngineConfig(_Section):
    backend: Literal["torch", "tensorrt_llm"] = "torch"
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="cpu | cuda | cuda:N")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks per replica")
    num_beams: int = Field(4, ge=1, le=16, description="ReDrafter beams drafted per step")
    draft_len_per_beam: int = Field(4, ge=1, le=16, description="draft tokens per beam")
    max_seq_len: int = Field(2048, ge=16, description="context length: prompt + completion tokens")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads; null = cores / replicas")
    spec_schedule: SpecSchedule | None = Field(
        None, description="'off' or rows {max_batch_size, num_beams, draft_len_per_beam} (speculation "
        "schedule by number of generation requests); null = num_beams x draft_len_per_beam at every batch size",
    )
    max_batch_size: int = Field(16, ge=1, description="requests decoded together (in-flight batching)")
    max_num_tokens: int = Field(2048, ge=16, description="tokens per iteration: context chunks + draft trees")
    max_prefill_chunk: int | None = Field(512, ge=1, description="context tokens of one request per iteration")
    tokens_per_block: int = Field(16, ge=1, description="paged KV cache block size")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV cache blocks; null = sized by kv_cache_fraction")
    kv_cache_fraction: float = Field(0.2, gt=0, le=1, description="share of free memory for the KV cache")


class RouterConfig(_Section):
    """Speculation policy, see ``cluster.router.choose_mode``.

    ``spec_max_load``: in ``auto`` mode a request is decoded speculatively when the replica's load
    (requests it holds, running or queued, counting the new one) is at most this; above it, plain.
    0 turns speculation off for ``auto`` requests.
    """

    spec_max_load: int = Field(4, ge=0)
    default_mode: Literal["auto", "spec", "plain"] = "auto"


class ServeConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    replicas: int = Field(1, ge=1, description="engine replicas, one Engine each")
    max_ongoing_requests: int = Field(
        64, ge=1, description="requests admitted to one replica at once (decoding together, or queued in its "
        "engine; they count as its load); beyond this they wait in Serve's queue",
    )
    max_queued_requests: int | None = Field(
        None, ge=1, description="requests waiting in Serve's queue before HTTP 503; null = unbounded"
    )


class RdserveConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)


def format_validation_error(err: ValidationError) -> str:
    """One line per problem: ``dotted.field: pydantic message``."""
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"{field}: {e['msg']}")
    return "\n".join(lines)


def parse_config(data: dict, base_dir: Path) -> RdserveConfig:
    """Validate a mapping; relative paths resolve against ``base_dir``.

    Raises:
        ConfigError: naming each offending field.
    """
    try:
        return RdserveConfig.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def load_config(path: str | Path) -> RdserveConfig:
    """Read and validate a YAML config file.

    Raises:
        ConfigError: unreadable file, invalid YAML, or invalid fields (each named).
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config file ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    try:
        return parse_config(data, path.resolve().parent)
    except ConfigError as err:
        raise ConfigError(f"{path}:\n{err}") from None


def check_startable(cfg: RdserveConfig, cuda_available: bool | None = None) -> None:
    """What this build can start: torch backend, an available device, existing paths.

    ``cuda_available`` defaults to ``torch.cuda.is_available()``.

    Raises:
        ConfigError: naming the field that cannot be honoured here.
    """
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
    if eng.tp_size > 1:
        from workers.models.config import LlamaConfig
        from workers.models.pull import default_model_dir
        from workers.tp.layers import check_tp_size

        model_dir = cfg.model.path or default_model_dir()  # the default model once pulled
        if (model_dir / "config.json").is_file():
            try:
                check_tp_size(LlamaConfig.from_dir(model_dir), eng.tp_size)
            except ValueError as err:
                raise ConfigError(f"engine.tp_size: {err} (model {model_dir})") from None
