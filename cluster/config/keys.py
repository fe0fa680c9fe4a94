"""``serve.api_keys``: where the keys come from (a list, ``{env: VAR}`` or ``{file: PATH}``) and reading them.

Keys are ``SecretStr`` in the config, so they print as ``**********``. That masked form (any key made
only of ``*``) is refused wherever keys are read, so a config dumped with it cannot turn it into the
key. The ingress's middleware that checks them is :mod:`cluster.ingress.auth`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pydantic import (BaseModel, ConfigDict, Field, SecretStr, ValidationError, ValidationInfo, field_validator,
                      model_validator)

KEY_PATTERN = r"^[!-~]{8,512}$"
"""A key: 8 to 512 printable ASCII characters without spaces (what fits an HTTP header token)."""


def is_masked(key: str) -> bool:
    """True for a key made only of ``*``: the form a ``SecretStr`` prints (``**********``), never a key."""
    return set(key) <= {"*"}


def refuse_masked(keys: list[str], where: str) -> None:
    """Raises ValueError naming ``where`` and the key's position when one of ``keys`` is masked."""
    for n, key in enumerate(keys, start=1):
        if is_masked(key):
            raise ValueError(f"key {n} of {where} is only '*' characters, the masked form a config prints for a key, "
                             "not a key; give the real keys, or read them with {env: RDSERVE_API_KEYS} or {file: PATH}")


class ApiKeySource(BaseModel):
    """Where the keys are read: exactly one of ``env`` (a variable name) or ``file`` (a path)."""

    model_config = ConfigDict(extra="forbid")
    env: str | None = Field(None, min_length=1, description="environment variable holding the keys "
                            "(comma- or whitespace-separated)")
    file: Path | None = Field(None, description="file holding the keys, one per line ('#' comments)")

    @field_validator("file")
    @classmethod
    def _relative_to_the_yaml(cls, path: Path | None, info: ValidationInfo) -> Path | None:
        base = (info.context or {}).get("base_dir")  # as cluster.config resolves its paths
        if path is None or base is None or path.expanduser().is_absolute():
            return path if path is None else path.expanduser()
        return (Path(base) / path).resolve()

    @model_validator(mode="after")
    def _exactly_one(self):
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of 'env' and 'file'")
        return self


def parse_api_keys(value, info: ValidationInfo):
    """``serve.api_keys`` before validation: null, a list of keys, or ``{env: VAR}`` / ``{file: PATH}``.

    Raises:
        ValueError: anything else, an empty list (one message, not one per union member), or a listed key
            made only of ``*`` (the masked form, see :func:`is_masked`).
    """
    if value is None or isinstance(value, ApiKeySource):
        return value
    if isinstance(value, dict):
        try:
            return ApiKeySource.model_validate(value, context=info.context)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'source'}: {e['msg']}" for e in err.errors())
            raise ValueError(f"{{env: VAR}} or {{file: PATH}} expected ({problems})") from None
    if isinstance(value, list):
        if not value:
            raise ValueError("an empty list; use null to turn API keys off")
        if not all(isinstance(k, (str, SecretStr)) for k in value):
            raise ValueError("every key must be a string")
        refuse_masked([k.get_secret_value() if isinstance(k, SecretStr) else k for k in value], "the list")
        return [k if isinstance(k, SecretStr) else SecretStr(k) for k in value]
    raise ValueError("must be a list of keys, {env: VAR} or {file: PATH}")


def resolve_keys(setting: list[SecretStr] | ApiKeySource | None, environ: dict | None = None) -> list[str] | None:
    """The configured keys as plain strings; None when API keys are off.

    Raises:
        ValueError: the variable is unset or the file unreadable, no key found, a key that is not
            8-512 printable characters without spaces, or one made only of ``*`` (the masked form).
            The message names where the keys came from, never a key.
    """
    if setting is None:
        return None
    if isinstance(setting, ApiKeySource):
        if setting.env is not None:
            where = f"environment variable {setting.env}"
            raw = (os.environ if environ is None else environ).get(setting.env)
            if raw is None:
                raise ValueError(f"{where} is not set")
            keys = raw.replace(",", " ").split()
        else:
            where = f"file {setting.file}"
            try:
                text = setting.file.read_text()
            except OSError as err:
                raise ValueError(f"cannot read {where} ({err.strerror})") from None
            keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    else:
        where, keys = "the list", [k.get_secret_value() for k in setting]
    if not keys:
        raise ValueError(f"{where} holds no key (use null to turn API keys off)")
    for n, key in enumerate(keys, start=1):
        if not re.fullmatch(KEY_PATTERN, key):
            raise ValueError(f"key {n} of {where} must be 8-512 printable characters without spaces")
    refuse_masked(keys, where)
    return keys
