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

from starlette.responses import JSONResponse

from cluster.config.keys import refuse_masked
from cluster.ingress.protocol import error_body

class ApiKeys:
    """The keys an ingress accepts (digests only); ``active`` False means every request passes."""

    def __init__(self, keys: list[str] | None = None):
        self.set(keys)

    def set(self, keys: list[str] | None) -> None:
        """Accept exactly ``keys`` from now on (None or empty: API keys off).

        Raises:
            ValueError: a key made only of ``*`` (the masked form, see :func:`is_masked`).
        """
        refuse_masked(keys or [], "the keys given")
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
