"""The HTTP ingress: OpenAI-compatible routes on FastAPI, served by a Ray Serve deployment.

A request's way: validate (pydantic; HTTP 400 naming the field) -> ``EngineRequest`` -> an
``EngineReplica`` through a streaming ``DeploymentHandle`` -> JSON response or server-sent events.
The replica's first stream item says whether the request was accepted (``Started``) or rejected
(``Failed``), so the HTTP status is known before any event is sent.
No ``from __future__ import annotations`` here: Serve's class-based ingress needs real annotations
for FastAPI to see request bodies.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    RequestError,
    error_body,
)
from cluster.replica import EngineRequest, Failed, Started
from cluster.responses import ChatFormat, CompletionFormat, sse, stats_of, usage_of

log = logging.getLogger("ray.serve")

HEALTH_TIMEOUT_S = 10.0

api = FastAPI(title="rdserve", description="OpenAI-compatible LLM serving with ReDrafter speculative decoding.")


@api.exception_handler(RequestValidationError)
async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 becomes OpenAI's 400; the message and ``param`` name the (first) bad field."""
    errors = exc.errors()
    if errors and errors[0]["type"] == "json_invalid":  # loc is a character offset, not a field
        return JSONResponse(error_body(f"body: invalid JSON ({errors[0]['msg']})", None), status_code=400)
    fields = [".".join(str(p) for p in e["loc"] if p != "body") for e in errors]
    message = "; ".join(f"{f or 'body'}: {e['msg']}" for f, e in zip(fields, errors))
    return JSONResponse(error_body(message, fields[0] or None), status_code=400)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown paths (404) and wrong methods (405) in the OpenAI error envelope."""
    return JSONResponse(error_body(str(exc.detail), None, "invalid_request_error"), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


@api.exception_handler(RequestError)
async def _rejected_request(_: Request, exc: RequestError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.param), status_code=400)


def _failed_response(failed: Failed) -> JSONResponse:
    kind = "invalid_request_error" if failed.status == 400 else "server_error"
    return JSONResponse(error_body(failed.message, failed.param, kind), status_code=failed.status)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, engine: DeploymentHandle, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.created = int(time.time())

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 when an engine replica answers within ``HEALTH_TIMEOUT_S``, with its load; else 503."""
        try:
            stats = await asyncio.wait_for(self.engine.stats.remote(), HEALTH_TIMEOUT_S)
        except Exception as err:
            return JSONResponse({"status": "unavailable", "error": str(err)}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model_name, **stats})

    @api.get("/v1/models")
    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created)])

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        self._check_model(body.model)
        req = EngineRequest(
            prompt=None, messages=[m.as_template_input() for m in body.messages], sampling=body.sampling_params(),
            max_tokens=body.requested_max_tokens, max_tokens_field=body.max_tokens_field, mode=body.requested_mode,
        )
        return await self._respond(req, body, ChatFormat(self.model_name))

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        self._check_model(body.model)
        req = EngineRequest(
            prompt=body.prompt_text, messages=None, sampling=body.sampling_params(),
            max_tokens=body.requested_max_tokens, max_tokens_field=body.max_tokens_field, mode=body.requested_mode,
        )
        return await self._respond(req, body, CompletionFormat(self.model_name))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError("model", f"model: '{model}' is not served here; available: '{self.model_name}'")

    async def _respond(self, req: EngineRequest, body: ChatCompletionRequest | CompletionRequest,
                       fmt: ChatFormat | CompletionFormat):
        stream: DeploymentResponseGenerator = self.engine.options(stream=True).generate.remote(req)
        try:
            started = await stream.__anext__()
        except BackPressureError as err:  # serve.max_queued_requests reached: retry later
            log.warning("request rejected: %s", err)
            return _failed_response(Failed(503, "server overloaded: too many queued requests, retry later"))
        except Exception as err:
            log.exception("engine replica unavailable")
            return _failed_response(Failed(500, f"engine unavailable: {type(err).__name__}: {err}"))
        if isinstance(started, Failed):
            return _failed_response(started)
        if body.stream:
            return StreamingResponse(self._events(stream, started, body.include_usage, fmt),
                                     media_type="text/event-stream")
        return await self._collect(stream, started, fmt)

    async def _collect(self, stream: DeploymentResponseGenerator, started: Started,
                       fmt: ChatFormat | CompletionFormat) -> JSONResponse | BaseModel:
        pieces, last = [], None
        try:
            async for item in stream:
                if isinstance(item, Failed):
                    return _failed_response(item)
                pieces.append(item.text)
                last = item
        except Exception as err:
            log.exception("generation stream broke")
            return _failed_response(Failed(500, f"engine error: {type(err).__name__}: {err}"))
        if last is None or not last.finished:
            return _failed_response(Failed(500, "engine error: the generation ended without a final step"))
        return fmt.response("".join(pieces), last.finish_reason, usage_of(last), stats_of(started, last))

    async def _events(self, stream: DeploymentResponseGenerator, started: Started, include_usage: bool,
                      fmt: ChatFormat | CompletionFormat) -> AsyncIterator[str]:
        """SSE body; on client disconnect the handle call is cancelled, which stops the engine."""
        finished = False
        try:
            for chunk in fmt.opening_chunks():
                yield sse(chunk)
            async for item in stream:
                if isinstance(item, Failed):
                    yield sse(error_body(item.message, item.param, "server_error"))
                    finished = True
                elif item.finished:
                    yield sse(fmt.chunk(item.text, item.finish_reason, stats_of(started, item)))
                    if include_usage:
                        yield sse(fmt.usage_chunk(usage_of(item)))
                    finished = True
                elif item.text:
                    yield sse(fmt.chunk(item.text))
            if not finished:
                yield sse(error_body("engine error: the generation ended without a final step", None, "server_error"))
        except Exception as err:
            log.exception("generation stream broke")
            yield sse(error_body(f"engine error: {type(err).__name__}: {err}", None, "server_error"))
        finally:
            if not finished:
                stream.cancel()
        yield "data: [DONE]\n\n"
