"""The ingress side of metrics: ``GET /metrics`` on the HTTP port and the ``request_failure`` counter.

``GET /metrics`` proxies the Prometheus text of Ray's metrics agent on the ingress's node (rdserve's
``ray_rdserve_*``, Ray Serve's ``ray_serve_*`` and Ray's own series), so ``curl HOST:PORT/metrics``
works as on a vLLM server. On a multi-node cluster each node's agent holds only that node's replicas:
Prometheus should scrape every node's metrics port (``observability.metrics_port``) instead, which is
what ``rdserve observability prometheus-config`` writes.
"""

from __future__ import annotations

import logging

import httpx
import ray
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.exceptions import RayServeException

from cluster.observability.metrics import BY_NAME
from cluster.observability.recorder import make_metric, start_at_zero

log = logging.getLogger("ray.serve")
PROXY_TIMEOUT_S = 5.0
_failure_counters: dict[str, object] = {}  # model name -> this ingress replica's request_failure counter


def failure_counter(model_name: str):
    """This process's ``request_failure`` counter for ``model_name``, created on first use with every
    known status at zero (:func:`~cluster.observability.recorder.start_at_zero`). The ingress calls it
    when it starts, so the series exist before the first failure."""
    if model_name not in _failure_counters:
        spec = BY_NAME["request_failure"]
        _failure_counters[model_name] = counter = make_metric(spec, model_name)
        start_at_zero(counter, spec)
    return _failure_counters[model_name]


def metrics_agent_url() -> str:
    """``http://ADDRESS:PORT/metrics`` of Ray's metrics agent on this process's node.

    Raises:
        RuntimeError: this node is not in ``ray.nodes()`` or has no metrics export port.
    """
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    raise RuntimeError(f"node {node_id} has no metrics export port in ray.nodes()")


class FailureCounter:
    """ASGI middleware counting ``request_failure{status}`` for ``/v1/`` requests: an HTTP status >= 400,
    or a 200 event stream that carries an error event (``data: {"error": ...}``, counted as 500)."""

    def __init__(self, app):
        self.app = app
        self.counter = None

    def _count(self, status: int) -> None:
        if self.counter is None:
            try:
                ctx = serve.get_replica_context()
            except RayServeException:  # not in a Serve replica (an app under test): nothing to record into
                self.counter = False
                return
            self.counter = failure_counter(ctx.servable_object.model_name)
        if self.counter:
            self.counter.inc(tags={"status": str(status)})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or "/v1/" not in scope["path"]:
            return await self.app(scope, receive, send)
        state = {"stream": False, "counted": False}

        async def watch(message):
            try:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    headers = dict(message.get("headers") or [])
                    state["stream"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                    if status >= 400:
                        state["counted"] = True
                        self._count(status)
                elif message["type"] == "http.response.body" and state["stream"] and not state["counted"] \
                        and b'data: {"error"' in message.get("body", b""):
                    state["counted"] = True
                    self._count(500)
            except Exception:  # counting must never break a response
                log.exception("counting a failed request")
            await send(message)

        await self.app(scope, receive, watch)


def add_metrics_routes(api: FastAPI) -> None:
    """Install ``GET /metrics`` and :class:`FailureCounter` on the ingress's FastAPI app."""
    api.add_middleware(FailureCounter)
    agent: dict[str, str] = {}

    @api.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        """Prometheus text of this node's Ray metrics agent; 503 naming the agent when it does not answer."""
        try:
            agent.setdefault("url", metrics_agent_url())
            async with httpx.AsyncClient(timeout=PROXY_TIMEOUT_S) as client:
                reply = await client.get(agent["url"])
            reply.raise_for_status()
        except (httpx.HTTPError, RuntimeError) as err:
            return JSONResponse({"error": {"message": f"Ray's metrics agent ({agent.get('url', 'unknown')}) did "
                                           f"not answer: {err}", "type": "server_error"}}, status_code=503)
        return Response(reply.content, media_type=reply.headers.get("content-type", "text/plain; version=0.0.4"))
