"""How the ingress reaches an engine replica: through a Serve deployment handle, or in its own process.

The ingress (:mod:`cluster.openai_api`) needs three things of an engine: stream a request's items
(``Started``, ``GenerationDelta``..., or one ``Failed``; see :class:`cluster.replica.EngineReplica`),
its stats (``/health``) and its routing stats (two-pool mode). :class:`HandleClient` asks a separate
engine deployment over Ray; :class:`InProcessClient` calls an ``EngineReplica`` object that lives in
the ingress's own process (``serve.colocate``, :mod:`cluster.colocated`), so a token goes from the
engine thread to the HTTP response on one event loop, with no Ray call on its way.

Both streams are async iterators with ``cancel()`` (a cancelled request is aborted in the engine,
its KV blocks free at the next iteration).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from ray.serve.exceptions import BackPressureError


class ResponseStream(Protocol):
    def __aiter__(self) -> AsyncIterator: ...

    async def __anext__(self) -> Any: ...

    def cancel(self) -> None: ...


class HandleClient:
    """An engine deployment behind a ``DeploymentHandle`` (``handle.deployment_name``: its Serve name).

    Its stream raises ``BackPressureError`` when Serve's queue is full (``serve.max_queued_requests``).
    """

    def __init__(self, handle):
        self.handle = handle
        self.deployment_name: str = handle.deployment_name

    def stream(self, request) -> ResponseStream:
        return self.handle.options(stream=True).generate.remote(request)

    async def stats(self) -> dict:
        return await self.handle.stats.remote()

    async def routing_stats(self) -> dict:
        return await self.handle.record_routing_stats.remote()


class InProcessClient:
    """An ``EngineReplica`` object in this process, admitted as Serve admits to a replica.

    At most ``max_ongoing_requests`` requests are in the engine at once (``serve.max_ongoing_requests``);
    the others wait here in arrival order, and a request that would make more than ``max_queued_requests``
    wait (``serve.max_queued_requests``; None: no bound) is refused with ``BackPressureError`` (the
    ingress answers 503). Use from one event loop.
    """

    def __init__(self, replica, deployment_name: str, max_ongoing_requests: int, max_queued_requests: int | None):
        self.replica = replica
        self.deployment_name = deployment_name
        self.max_queued_requests = max_queued_requests
        self.slots = asyncio.Semaphore(max_ongoing_requests)
        self.waiting = 0

    def stream(self, request) -> ResponseStream:
        return _LocalStream(self, request)

    async def stats(self) -> dict:
        return self.replica.stats()

    async def routing_stats(self) -> dict:
        return self.replica.record_routing_stats()

    async def admit(self) -> None:
        """Wait for an engine slot.

        Raises:
            BackPressureError: ``max_queued_requests`` are waiting already.
        """
        if self.slots.locked() and self.max_queued_requests is not None and self.waiting >= self.max_queued_requests:
            raise BackPressureError(num_queued_requests=self.waiting, max_queued_requests=self.max_queued_requests)
        self.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1


class _LocalStream:
    """One request on an :class:`InProcessClient`: waits for a slot at its first ``__anext__``, then
    iterates ``replica.generate``; the slot is given back exactly once, when the stream ends, fails, is
    cancelled or is dropped."""

    def __init__(self, client: InProcessClient, request):
        self.client, self.request = client, request
        self.items = None
        self.holds_slot = False
        self.over = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.over:
            raise StopAsyncIteration
        try:
            if self.items is None:
                await self.client.admit()
                self.holds_slot = True
                self.items = self.client.replica.generate(self.request)
            return await anext(self.items)
        except BaseException:  # StopAsyncIteration included; a cancelled wait (deadline) closes the generator too
            self._end()
            raise

    def cancel(self) -> None:
        """Abort the request: the engine drops it before its next iteration (a wait in ``__anext__``
        that is being cancelled by its task ends it the same way)."""
        items = self.items
        if items is not None and not self.over and not items.ag_running:
            asyncio.ensure_future(items.aclose())  # runs the generator's cleanup: the engine's abort
        self._end()

    def _end(self) -> None:
        self.over = True
        if self.holds_slot:
            self.holds_slot = False
            self.client.slots.release()

    def __del__(self):
        if self.holds_slot:
            self.holds_slot = False
            self.client.slots.release()
