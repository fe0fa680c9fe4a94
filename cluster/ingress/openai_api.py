"""The HTTP ingress: OpenAI-compatible routes on FastAPI, served by a Ray Serve deployment.

A request's way: validate (pydantic; HTTP 400 naming the field) -> ``EngineRequest`` -> an
``EngineReplica``, through a streaming ``DeploymentHandle`` or in this process (``serve.colocate``,
:mod:`cluster.ingress.clients`) -> JSON response or server-sent events.
The replica's first stream item says whether the request was accepted (``Started``) or rejected
(``Failed``), so the HTTP status is known before any event is sent.
No ``from __future__ import annotations`` here: Serve's class-based ingress needs real annotations
for FastAPI to see request bodies.
"""

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.ingress.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    RequestError,
    error_body,
    validation_error,
)
from cluster.ingress.auth import ApiKeys, BearerAuth
from cluster.config.keys import resolve_keys
from cluster.ingress.body_limit import BodyLimit, BodyLimitSetting
from cluster.config import ServeConfig
from cluster.ingress.disconnect import QuietDisconnect, info_now
from cluster.ingress.drain import Admission
from cluster.ingress.clients import HandleClient, InProcessClient, ResponseStream
from workers.speculation.goodput import StepCosts
from cluster.observability.http import add_metrics_routes, failure_counter
from cluster.ingress.limits import RETRY_AFTER_MIN_S, Interrupted, RequestGuard
from cluster.ingress.pools import PoolLoad, TrackedStream
from cluster.ingress.messages import EngineRequest, Failed, Started
from cluster.ingress.responses import ChatFormat, CompletionFormat, sse, stats_of, usage_of
from cluster.ingress.tools import ToolCallStream
from cluster.ingress.serve_state import replica_counts

log = logging.getLogger("ray.serve")

HEALTH_TIMEOUT_S = 10.0
REPLICA_COUNTS_TIMEOUT_S = 2.0
POOL_REFRESH_S = 1.0
STREAM_END_GRACE_S = 1.0
"""After a request's last item, how long its stream may take to end (with a separate engine deployment
the end is its own Ray message) before it is cancelled."""

api = FastAPI(title="rdserve", description="OpenAI-compatible LLM serving with ReDrafter speculative decoding.")
API_KEYS = ApiKeys()  # installed by the ingress (one per process: a Serve replica); off until then
BODY_LIMIT = BodyLimitSetting()  # serve.max_request_body_bytes, installed by the ingress
api.add_middleware(BodyLimit, setting=BODY_LIMIT)  # inside the auth check: a keyless client is refused unread
api.add_middleware(BearerAuth, keys=API_KEYS)
api.add_middleware(QuietDisconnect)  # outermost: a client that left is a disconnect, not an exception
add_metrics_routes(api)  # GET /metrics, request_failure counts (outermost: sees 401s too)


@api.exception_handler(RequestValidationError)
async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 becomes OpenAI's 400; the message and ``param`` name the (first) bad field
    (:func:`cluster.ingress.protocol.validation_error`)."""
    errors = exc.errors()
    if errors and errors[0]["type"] == "json_invalid":  # loc is a character offset, not a field
        return JSONResponse(error_body(f"body: invalid JSON ({errors[0]['msg']})", None), status_code=400)
    err = validation_error(errors)
    return JSONResponse(error_body(err.message, err.param), status_code=400)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown paths (404) and wrong methods (405) in the OpenAI error envelope; a body FastAPI cannot
    parse (400) is named as ``body``."""
    message = f"body: {exc.detail}" if exc.status_code == 400 else str(exc.detail)
    return JSONResponse(error_body(message, None, "invalid_request_error"), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


class ModelNotFound(Exception):
    """A request for a model this server does not serve: 404 ``model_not_found`` (as OpenAI and vLLM)."""


@api.exception_handler(ModelNotFound)
async def _model_not_found(_: Request, exc: ModelNotFound) -> JSONResponse:
    return JSONResponse(error_body(str(exc), "model", "invalid_request_error", "model_not_found"), status_code=404)


@api.exception_handler(RequestError)
async def _rejected_request(_: Request, exc: RequestError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.param), status_code=400)


def _failed_response(failed: Failed) -> JSONResponse:
    kind = "invalid_request_error" if failed.status == 400 else "server_error"
    return JSONResponse(error_body(failed.message, failed.param, kind), status_code=failed.status)


def _unavailable(message: str, retry_after_s: int) -> JSONResponse:
    """503 with ``Retry-After`` (seconds; see :mod:`cluster.ingress.limits`)."""
    return JSONResponse(error_body(message, None, "server_error"), status_code=503,
                        headers={"Retry-After": str(retry_after_s)})


async def _end_stream(stream: ResponseStream) -> None:
    """Let a stream whose last item (finished, or ``Failed``) is in hand end outside the request's
    deadline and drain switch, so neither turns a complete answer into an error; one that does not
    end within ``STREAM_END_GRACE_S`` (or sends more) is cancelled. Either way the stream's accounting
    (a pool's count, an in-process engine slot) runs once."""
    ended = False
    try:
        async with asyncio.timeout(STREAM_END_GRACE_S):
            await anext(stream)
    except StopAsyncIteration:
        ended = True
    except Exception as err:  # TimeoutError, or an error after the last item: the answer stands
        log.debug("stream did not end after its last item: %r", err)
    finally:
        if not ended:
            stream.cancel()


def _interrupted_response(err: Interrupted) -> JSONResponse:
    """Before the first byte: a timed-out request is 504, one aborted by a drain 503 with
    ``Retry-After: RETRY_AFTER_MIN_S`` (another replica, or this server restarted, can take it)."""
    if err.reason == "timeout":
        return JSONResponse(error_body(err.message, None, "server_error", err.reason), status_code=504)
    return JSONResponse(error_body(err.message, None, "server_error", err.reason), status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_MIN_S)})


INGRESS_MAX_ONGOING_REQUESTS = 256
"""Requests one ingress replica holds at once (streams included); more wait in Serve's proxy."""


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS)
@serve.ingress(api)
class OpenAIIngress:
    """``engine``: the engine deployment's handle (or an :class:`InProcessClient`, :mod:`cluster.replica.colocated`),
    or in two-pool mode ``{"spec": handle, "plain": handle}`` with ``pool_policy``
    ``{"calibration": path, "shape": [num_beams, draft_len_per_beam]}`` (the spec pool's shape); each request then goes to the pool :mod:`cluster.ingress.pools` chooses.
    ``serve_cfg``: API keys, body size cap, request timeout and drain timeout (``serve.*``; default: none of them)."""

    def __init__(self, engine: DeploymentHandle | InProcessClient | dict, model_name: str,
                 pool_policy: dict | None = None, serve_cfg: ServeConfig | None = None):
        serve_cfg = serve_cfg or ServeConfig()
        BODY_LIMIT.max_bytes = serve_cfg.max_request_body_bytes
        API_KEYS.set(resolve_keys(serve_cfg.api_keys))  # ValueError (never a key) when the env var/file is missing
        self.admission = Admission(serve_cfg.request_timeout_s)
        self.drain_timeout_s = serve_cfg.drain_timeout_s
        engines = engine if isinstance(engine, dict) else {"engine": engine}
        self.engines = {name: e if isinstance(e, InProcessClient) else HandleClient(e) for name, e in engines.items()}
        self.engine = next(iter(self.engines.values()))  # health's engine stats (the spec pool's with pools)
        self.model_name = model_name
        failure_counter(model_name)  # request_failure's series exist (at zero) before the first failure
        self.created = int(time.time())
        self.app_name = serve.get_replica_context().app_name
        self.pools = {name: e.deployment_name for name, e in self.engines.items()}  # for the replica counts
        self.pool_load = None
        self._refresh = None
        self._pools_ready = asyncio.Event()  # set once every pool's handle has answered (or failed) once
        if pool_policy is not None:
            self.pool_load = PoolLoad(StepCosts.load(pool_policy["calibration"]), tuple(pool_policy["shape"]))

    async def _refresh_pools(self) -> None:
        """Two-pool mode: every ``POOL_REFRESH_S``, the pools' running replicas and the spec pool's
        live tokens per step (what :meth:`PoolLoad.choose` weighs besides the ingress's own counts).

        First, one call through every pool's handle, so each handle's router has its replicas before
        the first request is routed: the first request of a fresh two-pool app, sent through a handle
        created for it, could go unrouted while calls sent through the same handle later were."""
        await asyncio.gather(*(asyncio.wait_for(c.routing_stats(), REPLICA_COUNTS_TIMEOUT_S)
                               for c in self.engines.values()), return_exceptions=True)
        self._pools_ready.set()
        while True:
            counts = await replica_counts(self.app_name, self.pools, REPLICA_COUNTS_TIMEOUT_S)
            for pool, count in (counts or {}).items():
                self.pool_load.replicas[pool] = max(1, count["running"])
            try:
                stats = await asyncio.wait_for(self.engines["spec"].routing_stats(), REPLICA_COUNTS_TIMEOUT_S)
                self.pool_load.tau = stats.get("tau") or self.pool_load.tau
            except Exception as err:  # keep the last estimate; the next refresh tries again
                log.warning("spec pool stats unavailable: %s", err)
            await asyncio.sleep(POOL_REFRESH_S)

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 when an engine replica answers within ``HEALTH_TIMEOUT_S``, with its load; else 503.

        Both carry ``replicas``: ``{pool: {running, starting, stopping, target}}`` from Serve's
        controller (null when it does not answer within ``REPLICA_COUNTS_TIMEOUT_S``).
        """
        replicas = asyncio.ensure_future(replica_counts(self.app_name, self.pools, REPLICA_COUNTS_TIMEOUT_S))
        try:
            stats = await asyncio.wait_for(self.engine.stats(), HEALTH_TIMEOUT_S)
            for name, client in self.engines.items():  # in two-pool mode every pool must answer
                if client is not self.engine:
                    await asyncio.wait_for(client.stats(), HEALTH_TIMEOUT_S)
        except Exception as err:
            return JSONResponse({"status": "unavailable", "error": str(err), "replicas": await replicas},
                                status_code=503)
        if stats.get("failure") or self.admission.draining:  # a broken engine (Serve replaces it), or a drain
            status, error = ("draining", "shutting down") if self.admission.draining else ("unavailable", stats["failure"])
            return JSONResponse({"status": status, "error": error, **stats, "replicas": await replicas}, status_code=503)
        pools = None if self.pool_load is None else {"in_flight": self.pool_load.in_flight, "spec_tau": self.pool_load.tau}
        return JSONResponse({"status": "ok", "model": self.model_name, **stats, "replicas": await replicas,
                             **({"pools": pools} if pools else {})})

    @api.get("/v1/models")
    async def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created)])

    @api.get("/v1/models/{model:path}")
    async def model(self, model: str) -> ModelCard:
        """OpenAI's retrieve-model; an id may hold ``/`` (``org/name``). 404 ``model_not_found`` for another id."""
        self._check_model(model)
        return ModelCard(id=self.model_name, created=self.created)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        self._check_model(body.model)
        req = EngineRequest(
            prompt=None, messages=[m.as_template_input() for m in body.messages], sampling=body.sampling_params(),
            max_tokens=body.requested_max_tokens, max_tokens_field=body.max_tokens_field, mode=body.requested_mode,
            grammar_field=body.grammar_field, tools=body.tool_dicts,
        )
        return await self._respond(req, body, ChatFormat(self.model_name, ToolCallStream() if body.uses_tools else None))

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        self._check_model(body.model)
        req = EngineRequest(
            prompt=body.prompt_text, messages=None, sampling=body.sampling_params(),
            max_tokens=body.requested_max_tokens, max_tokens_field=body.max_tokens_field, mode=body.requested_mode,
            grammar_field=body.grammar_field,
        )
        fmt = CompletionFormat(self.model_name, echo=body.prompt_text if body.echo else None,
                               show_prompt_logprobs=body.prompt_logprobs is not None)
        return await self._respond(req, body, fmt)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFound(f"model: '{model}' does not exist here; available: '{self.model_name}'")

    async def drain(self, timeout_s: float | None = None) -> dict:
        """Graceful drain (:mod:`cluster.ingress.drain`), called through a handle by ``rdserve up`` on SIGTERM:
        503 + ``Retry-After`` for new requests, ``timeout_s`` (default ``serve.drain_timeout_s``) for those
        in flight, then the rest end with an error. Returns the drain's report."""
        return await self.admission.drain(self.drain_timeout_s if timeout_s is None else timeout_s)

    async def _respond(self, req: EngineRequest, body: ChatCompletionRequest | CompletionRequest,
                       fmt: ChatFormat | CompletionFormat):
        guard = self.admission.admit()
        if guard is None:
            return _unavailable("server shutting down: not admitting new requests", self.admission.retry_after())
        streaming = False
        try:
            response = await self._start(req, body, fmt, guard)
            streaming = isinstance(response, StreamingResponse)  # _events ends the request
            return response
        finally:
            if not streaming:
                self.admission.done(guard)

    async def _start(self, req: EngineRequest, body: ChatCompletionRequest | CompletionRequest,
                     fmt: ChatFormat | CompletionFormat, guard: RequestGuard):
        client, pool, reason = self.engine, None, None
        if self.pool_load is not None:
            if self._refresh is None:
                self._refresh = asyncio.ensure_future(self._refresh_pools())
            if not self._pools_ready.is_set():  # the first requests wait for the handles (bounded)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._pools_ready.wait(), 2 * REPLICA_COUNTS_TIMEOUT_S)
            pool, reason = (req.mode, f"pool {req.mode}: requested") if req.mode in ("spec", "plain") \
                else self.pool_load.choose()
            client, req = self.engines[pool], dataclasses.replace(req, mode=pool)
        stream: ResponseStream = client.stream(req)
        if pool is not None:
            self.pool_load.started(pool)
            stream = TrackedStream(stream, functools.partial(self.pool_load.finished, pool))
        try:
            started = await guard.next(stream)
        except BackPressureError as err:  # serve.max_queued_requests reached: retry later
            log.warning("request rejected: %s", err)
            return _unavailable("server overloaded: too many queued requests, retry later", self.admission.retry_after())
        except Interrupted as err:  # timed out (or drained) before its first token
            stream.cancel()
            info_now(log, "request %s ended: %s", fmt.id, err.reason)
            return _interrupted_response(err)
        except Exception as err:
            log.exception("engine replica unavailable")
            return _failed_response(Failed(500, f"engine unavailable: {type(err).__name__}: {err}"))
        if isinstance(started, Failed):
            await _end_stream(stream)  # the request is over: out of its pool, its engine slot free
            return _failed_response(started)
        if reason is not None:
            started = dataclasses.replace(started, reason=f"{reason}; replica: {started.reason}")
        headers = {"X-Rdserve-Replica": started.replica}
        if body.stream:
            return StreamingResponse(self._events(stream, started, body.include_usage, fmt, guard),
                                     media_type="text/event-stream", headers=headers)
        response = await self._collect(stream, started, fmt, guard)
        if isinstance(response, BaseModel):
            response = JSONResponse(jsonable_encoder(response), headers=headers)
        return response

    async def _collect(self, stream: ResponseStream, started: Started,
                       fmt: ChatFormat | CompletionFormat, guard: RequestGuard) -> JSONResponse | BaseModel:
        pieces, last, logprobs, prompt_logprobs = [], None, None, None
        try:
            async for item in guard.items(stream):
                if isinstance(item, Failed):
                    await _end_stream(stream)
                    return _failed_response(item)
                pieces.append(item.text)
                if item.logprobs is not None:
                    logprobs = (logprobs or []) + item.logprobs
                if item.prompt_logprobs is not None:
                    prompt_logprobs = item.prompt_logprobs
                last = item
                if item.finished:
                    await _end_stream(stream)
                    break
        except Interrupted as err:
            stream.cancel()
            info_now(log, "request %s ended: %s", fmt.id, err.reason)
            return _interrupted_response(err)
        except Exception as err:
            log.exception("generation stream broke")
            return _failed_response(Failed(500, f"engine error: {type(err).__name__}: {err}"))
        if last is None or not last.finished:
            return _failed_response(Failed(500, "engine error: the generation ended without a final step"))
        return fmt.response("".join(pieces), last.finish_reason, usage_of(last), stats_of(started, last),
                            logprobs, prompt_logprobs)

    async def _events(self, stream: ResponseStream, started: Started, include_usage: bool,
                      fmt: ChatFormat | CompletionFormat, guard: RequestGuard) -> AsyncIterator[str]:
        """SSE body; on client disconnect the handle call is cancelled, which stops the engine
        (logged at INFO with the response id); a timeout or an aborting drain ends it with an error event
        (never after the last item: the stream's end is then awaited outside the deadline)."""
        finished = False
        try:
            for chunk in fmt.opening_chunks():
                yield sse(chunk)
            async for item in guard.items(stream):
                if isinstance(item, Failed):
                    yield sse(error_body(item.message, item.param, "server_error"))
                    break
                if item.finished:
                    yield sse(fmt.chunk(item.text, item.finish_reason, stats_of(started, item),
                                        item.logprobs, item.prompt_logprobs))
                    if include_usage:
                        yield sse(fmt.usage_chunk(usage_of(item)))
                    break
                if item.text or item.logprobs or item.prompt_logprobs is not None:
                    yield sse(fmt.chunk(item.text, logprobs=item.logprobs, prompt_logprobs=item.prompt_logprobs))
            else:  # the stream ended without its last item
                finished = True
                yield sse(error_body("engine error: the generation ended without a final step", None, "server_error"))
            if not finished:  # left at the last item: the stream ends (or is cancelled) outside the guard
                finished = True
                await _end_stream(stream)
        except Interrupted as err:
            info_now(log, "request %s ended: %s", fmt.id, err.reason)
            yield sse(error_body(err.message, None, "server_error", err.reason))
        except Exception as err:
            log.exception("generation stream broke")
            yield sse(error_body(f"engine error: {type(err).__name__}: {err}", None, "server_error"))
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            info_now(log, "request %s cancelled by the client", fmt.id)
            raise
        finally:
            if not finished:
                stream.cancel()
            self.admission.done(guard)
        yield "data: [DONE]\n\n"
