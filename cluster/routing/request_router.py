"""``serve.request_router: goodput``: the Ray Serve request router of the engine replicas.

A thin adapter between Ray Serve's ``RequestRouter`` (it runs inside every ``DeploymentHandle`` to
the replicas, here the ingress's) and :mod:`cluster.routing.ranking`: each ``choose_replicas``
orders the candidates by the request's expected completion time from their routing stats and what
this router sent them since. The order goes back as one-replica tiers, so Serve sends the request
to the first replica unless it is at ``max_ongoing_requests`` (then the next), and backs off while
every replica is full.

Not ``FIFOMixin``: with it a replica found for one request is handed to the oldest pending one,
and the ranking depends on the request's size (KV admission), so each request keeps its own
choice, as Ray's prefix-cache and KV-aware routers do.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import replace

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from cluster.ingress.protocol import DEFAULT_MAX_TOKENS
from cluster.ingress.messages import EngineRequest
from cluster.routing.ranking import TIE_TOLERANCE, RecentPrefixes, SentSinceStats, rank_replicas
from workers.text_prefix import routing_text, text_block_hashes

CHARS_PER_TOKEN = 3
"""Prompt tokens are estimated as characters / 3, rounded up: BPE tokenizers average about 4
characters per token on English text, so this leans high and KV admission errs on the safe side."""

TEMPLATE_TOKENS_PER_MESSAGE = 8
"""Chat-template tokens added per message (role markers, separators), estimated."""


def request_size(args: list) -> tuple[int, int]:
    """``(prompt_tokens, max_tokens)`` estimated for a call whose first argument is an
    ``EngineRequest`` (``generate``), its tools' JSON counted as prompt; ``max_tokens`` None counts as ``DEFAULT_MAX_TOKENS``. Other
    calls (``stats``, health probes) count as ``(0, 1)``."""
    req = args[0] if args else None
    if not isinstance(req, EngineRequest):
        return 0, 1
    if req.messages is None:
        prompt_tokens = math.ceil(len(req.prompt or "") / CHARS_PER_TOKEN)
    else:
        chars = sum(len(str(m.get("content", ""))) for m in req.messages)
        chars += len(json.dumps(req.tools, ensure_ascii=False, default=str)) if req.tools else 0
        prompt_tokens = math.ceil(chars / CHARS_PER_TOKEN) + TEMPLATE_TOKENS_PER_MESSAGE * len(req.messages)
    return prompt_tokens, req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS


MAX_HASHED = 4096
"""Requests whose routing-text hashes a router keeps between ranking and routing (oldest dropped)."""


def prefix_hashes(args: list) -> list[int] | None:
    """The routing-text block hashes (:mod:`workers.text_prefix`) of a ``generate`` call's
    ``EngineRequest``; None for other calls."""
    req = args[0] if args else None
    if not isinstance(req, EngineRequest):
        return None
    return text_block_hashes(routing_text(req.prompt, req.messages, req.tools, req.sampling.cache_salt))


class GoodputRequestRouter(RequestRouter):
    """Orders replicas by expected completion time (``cluster.routing.ranking``), prefill of the
    prompt positions each replica has not cached included.

    ``request_router_kwargs``: ``tie_tolerance`` (relative; default ``TIE_TOLERANCE``), ``seed``
    (of the tie-breaking random generator; default None: from the OS) and ``prefix_aware`` (weigh
    each replica's prefix cache; default True; ``serve.prefix_aware_routing``).
    """

    def initialize_state(self, tie_tolerance: float = TIE_TOLERANCE, seed: int | None = None,
                         prefix_aware: bool = True) -> None:
        self.tie_tolerance = tie_tolerance
        self.rng = random.Random(seed)
        self.sent = SentSinceStats()
        self.prefix_aware = prefix_aware
        self.recent = RecentPrefixes()
        self._hashed: dict[str, list[int] | None] = {}  # internal request id -> its routing-text hashes

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        args = pending_request.args if pending_request is not None else []
        prompt_tokens, max_tokens = request_size(args)
        now = time.monotonic()
        candidates = self.sent.candidates(
            [(r.replica_id, r.routing_stats, r.max_ongoing_requests) for r in candidate_replicas], now)
        hashes = self._hashes(pending_request) if self.prefix_aware and pending_request is not None else None
        if hashes:
            candidates = [replace(c, recent_hashes=self.recent.of(c.replica, now)) for c in candidates]
        ranked = rank_replicas(candidates, prompt_tokens, max_tokens, self.rng, self.tie_tolerance, hashes)
        if pending_request is not None and ranked:
            pending_request.routing_context.should_backoff = True  # every replica full: back off, then retry
            self.sent.chosen(ranked[0], pending_request.metadata.internal_request_id, prompt_tokens + max_tokens, now)
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[replica_id]] for replica_id in ranked]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """New replica list or routing stats (a broadcast from the controller): note the stats as they
        arrive, forget replicas that are gone."""
        for r in replicas:
            self.sent.observe(r.replica_id, r.routing_stats)
        self.sent.forget_except({r.replica_id for r in replicas})
        self.recent.forget_except({r.replica_id for r in replicas})
        super().update_replicas(replicas)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        prompt_tokens, max_tokens = request_size(pending_request.args)
        self.sent.routed(replica_id, pending_request.metadata.internal_request_id, prompt_tokens + max_tokens)
        hashes = self._hashed.pop(pending_request.metadata.internal_request_id, None)
        if self.prefix_aware and hashes:
            self.recent.sent(replica_id, hashes, time.monotonic())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.sent.completed(replica_id, internal_request_id)
        self._hashed.pop(internal_request_id, None)

    def _hashes(self, pending_request: PendingRequest) -> list[int] | None:
        """The request's routing-text hashes, computed once per request (``choose_replicas`` runs again
        on every backoff): kept until it is routed or completed, for at most ``MAX_HASHED`` requests."""
        request_id = pending_request.metadata.internal_request_id
        if request_id not in self._hashed:
            while len(self._hashed) >= MAX_HASHED:  # requests cancelled before they were routed
                del self._hashed[next(iter(self._hashed))]
            self._hashed[request_id] = prefix_hashes(pending_request.args)
        return self._hashed[request_id]
