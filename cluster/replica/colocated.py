"""The engine inside the ingress replica (``serve.colocate``): one process from HTTP request to engine.

With a separate engine deployment every token goes engine thread -> replica event loop -> a Ray
streaming call -> the ingress process's event loop -> HTTP. On a
small CPU machine each of those wake-ups takes a core from the engine's OpenMP threads, and served
decoding ran at 0.77-0.89x the engine in process (``benchmarks/served_vs_engine.py``). When the
application has one engine replica anyway, :class:`ColocatedIngress` builds that replica
(:class:`cluster.replica.replica.EngineReplica`, unchanged) in its own process and streams from it through
:class:`cluster.ingress.clients.InProcessClient`: the engine thread hands a token to the event loop that
writes the HTTP response.

Everything else is the ingress's (:class:`cluster.ingress.openai_api.OpenAIIngress`): routes, auth, limits,
drain, ``/health``. Serve's health probe reaches the engine (``check_health``), and the replica's
operator and test hooks (``stats``, ``processes``, ``stall_engine_for_test``) answer on this
deployment's handle as they do on ``EngineReplica``'s.
"""

from __future__ import annotations

from ray import serve

from cluster.config import RdserveConfig
from cluster.ingress.clients import InProcessClient
from cluster.ingress.openai_api import OpenAIIngress
from cluster.replica.replica import EngineReplica


class ColocatedIngress(OpenAIIngress.func_or_class):
    """The OpenAI ingress with its engine replica built in this process (``cfg.serve.colocated(...)``)."""

    async def __init__(self, cfg: RdserveConfig):
        self.replica = EngineReplica.func_or_class(cfg)  # builds the engine on its own thread
        name = serve.get_replica_context().replica_id.deployment_id.name
        client = InProcessClient(self.replica, name, cfg.serve.max_ongoing_requests, cfg.serve.max_queued_requests)
        if self.replica.metrics is not None:
            self.replica.metrics.queued = lambda: client.waiting  # Serve's queue was the gauge of it before
        await super().__init__(client, cfg.model.name, serve_cfg=cfg.serve)

    def check_health(self) -> None:
        """Serve's health probe: see :meth:`EngineReplica.check_health` (raises ``RuntimeError``)."""
        self.replica.check_health()

    async def stats(self) -> dict:
        return await self.engine.stats()  # the in-process client's: the replica's, with its queue

    def processes(self) -> dict:
        return self.replica.processes()

    def stall_engine_for_test(self, seconds: float) -> None:
        self.replica.stall_engine_for_test(seconds)
