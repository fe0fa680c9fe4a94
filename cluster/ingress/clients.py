"""How the ingress reaches an engine replica: through a Serve deployment handle, or in its own process.

The ingress (:mod:`cluster.ingress.openai_api`) needs three things of an engine: stream a request's items
(``Started``, ``GenerationDelta``..., or one ``Failed``; see :class:`cluster.replica.replica.EngineReplica`),
its stats (``/health``) and its routing stats (two-pool mode). :class:`HandleClient` asks a separate
engine deployment over Ray; :class:`InProcessClient` calls an ``EngineReplica`` object that lives in
the ingress's own process (``serve.colocate``, :mod:`cluster.replica.colocated`), so a token goes from the
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
        self.waiting = 0  # requests waiting here for a slot (Serve's queue, with a separate deployment)
        self.closing: set[asyncio.Task] = set()  # generators being closed by cancel()

    def stream(self, request) -> ResponseStream:
        return _LocalStream(self, request, asyncio.get_running_loop())

    async def stats(self) -> dict:
        """The replica's stats (``EngineReplica.stats``) and ``queued``: requests waiting for a slot."""
        return {**self.replica.stats(), "queued": self.waiting}

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
    iterates ``replica.generate``; the slot is given back exactly once, when the generator has ended
    (finished, failed, cancelled or closed), or when the stream is dropped."""

    def __init__(self, client: InProcessClient, request, loop: asyncio.AbstractEventLoop):
        self.client, self.request, self.loop = client, request, loop
        self.items = None
        self.holds_slot = False
        self.over = False
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.over:
            raise StopAsyncIteration
        try:
            if self.items is None:
                await self.client.admit()
                self.holds_slot = True
                if self.cancelled:  # cancelled while it waited for the slot
                    raise StopAsyncIteration
                self.items = self.client.replica.generate(self.request)
            item = await anext(self.items)
        except BaseException:  # StopAsyncIteration included; a cancelled wait (deadline) closes the generator too
            self._end()
            raise
        if self.cancelled:  # cancel() came from elsewhere while this wait ran: end here
            await self.items.aclose()
            self._end()
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        """Abort the request: the engine drops it before its next iteration. While another task waits
        in ``__anext__`` the request ends when that wait returns (a wait that is itself being cancelled
        ends it the same way); the slot is held until then."""
        items = self.items
        if self.over:
            return
        self.cancelled = True
        if items is not None and items.ag_running:
            return
        if items is not None:
            task = asyncio.ensure_future(items.aclose())  # runs the generator's cleanup: the engine's abort
            self.client.closing.add(task)
            task.add_done_callback(self.client.closing.discard)
        self._end()

    def _end(self) -> None:
        self.over = True
        if self.holds_slot:
            self.holds_slot = False
            self.client.slots.release()

    def __del__(self):
        if self.holds_slot:  # the garbage collector may run this on any thread: release on the loop's
            self.holds_slot = False
            try:
                self.loop.call_soon_threadsafe(self.client.slots.release)
            except RuntimeError:  # the loop is closed: nothing waits for the slot
                pass
