"""Request body size cap at the ingress: HTTP 413 in the OpenAI error format, before any parsing.

A request whose ``Content-Length`` exceeds the cap is refused without reading its body. One without
``Content-Length`` (chunked) is read up to the cap and refused when it goes past it; a body within
the cap is replayed to the app unchanged, so memory per request is bounded by the cap. The cap is
``serve.max_request_body_bytes`` (RFC 9110 Sec. 15.5.14, 413 Content Too Large).
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from cluster.ingress.protocol import error_body

DEFAULT_MAX_BODY_BYTES = 1 << 20


class BodyLimitSetting:
    """The cap one ingress applies (bytes); None: no cap. Set by the ingress after the app is built."""

    def __init__(self, max_bytes: int | None = DEFAULT_MAX_BODY_BYTES):
        self.max_bytes = max_bytes


def too_large(max_bytes: int) -> JSONResponse:
    return JSONResponse(error_body(f"request body larger than {max_bytes} bytes (serve.max_request_body_bytes)",
                                   None, "invalid_request_error", "request_too_large"), status_code=413)


class BodyLimit:
    """Pure ASGI middleware enforcing :class:`BodyLimitSetting` on every HTTP request with a body."""

    def __init__(self, app, setting: BodyLimitSetting):
        self.app = app
        self.setting = setting

    async def __call__(self, scope, receive, send) -> None:
        limit = self.setting.max_bytes
        if scope["type"] != "http" or limit is None:
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > limit:
                await too_large(limit)(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the HTTP server reads no more than Content-Length
            return
        chunks, size = [], 0
        while True:  # chunked: read up to the cap, then replay
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)  # a disconnect: replayed as is
                break
            size += len(message.get("body", b""))
            if size > limit:
                await too_large(limit)(scope, receive, send)
                return
            chunks.append(message)
            if not message.get("more_body", False):
                break
        replay = iter(chunks)

        async def replayed():
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)
