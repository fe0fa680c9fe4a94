"""Optional API keys: ``Authorization: Bearer KEY`` on every ``/v1/*`` route (``serve.api_keys``).

Keys come from the config (a list), or from an environment variable or a file named there, so they
stay out of YAML files in git (``{env: RDSERVE_API_KEYS}``: comma- or whitespace-separated;
``{file: PATH}``: one key per line, ``#`` comments). They are resolved where the ingress runs
(its Ray actor), so in Kubernetes the variable or file comes from a Secret on the pod.

Only SHA-256 digests of the keys are kept; a presented key is hashed and compared with every digest
by ``hmac.compare_digest`` (constant time, and the same work whichever key matches or none).
Keys are ``SecretStr`` in the config, so they print as ``**********``; no error, log line or metric
label ever carries a presented or configured key. That masked form (any key made only of ``*``) is refused
wherever keys are read, so a config dumped with it (``serve deploy`` of a printed config) cannot turn it
into the key. ``/health`` (and anything outside ``/v1``) stays open, for load balancers and Kubernetes
probes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from pathlib import Path

from pydantic import (BaseModel, ConfigDict, Field, SecretStr, ValidationError, ValidationInfo, field_validator,
                      model_validator)
from starlette.responses import JSONResponse

from cluster.protocol import error_body

KEY_PATTERN = r"^[!-~]{8,512}$"
"""A key: 8 to 512 printable ASCII characters without spaces (what fits an HTTP header token)."""


def is_masked(key: str) -> bool:
    """True for a key made only of ``*``: the form a ``SecretStr`` prints (``**********``), never a key."""
    return set(key) <= {"*"}


def _refuse_masked(keys: list[str], where: str) -> None:
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
        _refuse_masked([k.get_secret_value() if isinstance(k, SecretStr) else k for k in value], "the list")
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
    _refuse_masked(keys, where)
    return keys


class ApiKeys:
    """The keys an ingress accepts (digests only); ``active`` False means every request passes."""

    def __init__(self, keys: list[str] | None = None):
        self.set(keys)

    def set(self, keys: list[str] | None) -> None:
        """Accept exactly ``keys`` from now on (None or empty: API keys off).

        Raises:
            ValueError: a key made only of ``*`` (the masked form, see :func:`is_masked`).
        """
        _refuse_masked(keys or [], "the keys given")
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys or []]

    @property
    def active(self) -> bool:
        return bool(self._digests)

    def accepts(self, authorization: str | None) -> bool:
        """True for an ``Authorization`` header value ``Bearer <a configured key>`` (scheme case-insensitive)."""
        scheme, _, presented = (authorization or "").strip().partition(" ")
        digest = hashlib.sha256(presented.strip().encode()).digest()
        match = False
        for known in self._digests:  # every digest is compared: the time does not tell which key matched
            match |= hmac.compare_digest(digest, known)
        return match and scheme.lower() == "bearer"


def needs_key(path: str) -> bool:
    """Routes behind the keys: ``/v1`` and everything under it (not ``/health``)."""
    return path == "/v1" or path.startswith("/v1/")


UNAUTHORIZED = error_body("Authorization: missing or invalid API key; send the header 'Authorization: Bearer "
                          "<key>' with one of the keys in serve.api_keys", None, "invalid_request_error",
                          "invalid_api_key")


class BearerAuth:
    """ASGI middleware: a ``/v1`` request without an accepted key gets 401 in the OpenAI error format.

    Pure ASGI (no per-chunk wrapping of streamed responses). ``keys`` is read per request, so the
    ingress can install its keys after the app is built.
    """

    def __init__(self, app, keys: ApiKeys):
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.keys.active:
            path, root = scope["path"], scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root):] or "/"
            if needs_key(path):
                headers = dict(scope["headers"])
                value = headers.get(b"authorization")
                if not self.keys.accepts(value.decode("latin-1") if value is not None else None):
                    response = JSONResponse(UNAUTHORIZED, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)
