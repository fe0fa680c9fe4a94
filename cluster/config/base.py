"""The ground floor of the config: the error type, the section base, the model and drafter sections.

Path rule: a relative ``model.path`` or ``drafter.path`` (and any other path field) is resolved
against the directory that holds the YAML file (``ValidationInfo.context["base_dir"]``), not the
current working directory, so ``configs/local.yaml`` works from anywhere.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ConfigError(ValueError):
    """A configuration problem; the message names the offending field (``section.key: reason``)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def resolve_path(path: Path | None, info: ValidationInfo) -> Path | None:
    """Make a relative path absolute against ``info.context["base_dir"]`` (the YAML file's directory)."""
    if path is None:
        return None
    base = (info.context or {}).get("base_dir")
    path = path.expanduser()
    return (Path(base) / path).resolve() if base is not None and not path.is_absolute() else path


class ModelConfig(_Section):
    name: str = Field(DEFAULT_MODEL_NAME, min_length=1, description="model id served in the OpenAI API")
    path: Path | None = Field(None, description="Hugging Face directory; null = the default model, pulled")

    _resolve_path = field_validator("path")(resolve_path)


class DrafterConfig(_Section):
    path: Path | None = Field(None, description="ReDrafter draft-head directory; null = plain decoding only")

    _resolve_path = field_validator("path")(resolve_path)
