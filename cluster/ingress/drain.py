"""Admission and graceful drain at the ingress.

:class:`Admission` holds the requests in flight at one ingress (a :class:`~cluster.ingress.limits.RequestGuard`
each), how fast they complete, and whether the ingress is draining. A drain (``rdserve up`` on SIGTERM
or Ctrl-C, :func:`drain_app`): new ``/v1`` requests get 503 with ``Retry-After``; requests in flight
may finish for ``serve.drain_timeout_s``; the rest are then aborted, each ending with an error
(an error event in a stream, 503 before the first byte), and the process can exit cleanly.

Engine replicas that Serve stops (scale-down, replacement) are drained by Serve itself: no new
request is routed to them, and they are stopped once idle or after the deployment's
``graceful_shutdown_timeout_s`` (``serve.drain_timeout_s``, or ``autoscaling.graceful_shutdown_timeout_s``
with autoscaling); a stream still running then ends with an error event at the ingress.
"""

from __future__ import annotations

import asyncio
import logging
import time

from cluster.ingress.disconnect import info_now
from cluster.ingress.limits import CompletionRate, RequestGuard, retry_after_s

log = logging.getLogger("ray.serve")

ABORT_GRACE_S = 5.0
"""After aborting, how long a drain waits for the aborted requests to send their error and end."""


class Admission:
    """Requests in flight at one ingress; ``request_timeout_s`` None: no per-request limit."""

    def __init__(self, request_timeout_s: float | None):
        self.request_timeout_s = request_timeout_s
        self.in_flight: set[RequestGuard] = set()
        self.completed = CompletionRate()
        self.draining_until: float | None = None  # monotonic time the drain ends

    @property
    def draining(self) -> bool:
        return self.draining_until is not None

    def admit(self) -> RequestGuard | None:
        """A guard for a new request, registered in flight; None while draining (answer 503)."""
        if self.draining:
            return None
        guard = RequestGuard(self.request_timeout_s)
        self.in_flight.add(guard)
        return guard

    def done(self, guard: RequestGuard) -> None:
        """The request is over, however it ended (idempotent). It counts in the drain rate only if it
        left the queue (got its first stream item): a 503 rejection or a timeout in the queue drains
        nothing, and counting those would shrink ``Retry-After`` exactly when the queue is full."""
        if guard in self.in_flight:
            self.in_flight.discard(guard)
            if guard.started:
                self.completed.record()

    def retry_after(self) -> int:
        """``Retry-After`` seconds for a 503: while draining, the drain's time left (bounded); else from
        the requests waiting for their first token and the completion rate."""
        if self.draining:
            return retry_after_s(0, 1 / max(1.0, self.draining_until - time.monotonic()))
        waiting = sum(not g.started for g in self.in_flight)
        return retry_after_s(waiting, self.completed.per_s())

    async def drain(self, timeout_s: float, poll_s: float = 0.2) -> dict:
        """Stop admitting; wait up to ``timeout_s`` for the requests in flight; abort the rest.

        Returns ``{"finished": n, "aborted": m, "drain_s": seconds}``: requests that ended during the
        wait, and those aborted at its end.
        """
        start = time.monotonic()
        self.draining_until = start + timeout_s
        before = len(self.in_flight)
        info_now(log, "draining: %d requests in flight, up to %.0f s", before, timeout_s)
        while self.in_flight and time.monotonic() < self.draining_until:
            await asyncio.sleep(poll_s)
        left = list(self.in_flight)
        for guard in left:
            guard.abort("shutdown")
        deadline = time.monotonic() + ABORT_GRACE_S
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        report = {"finished": before - len(left), "aborted": len(left), "drain_s": round(time.monotonic() - start, 2)}
        info_now(log, "drained: %s", report)
        return report


def drain_app(app_name: str, timeout_s: float) -> dict:
    """Drain the ingress of a running Serve application (from a driver connected to Ray).

    Blocks up to ``timeout_s`` + ``ABORT_GRACE_S`` + 30 s; returns :meth:`Admission.drain`'s report.
    The ingress is one replica (``cluster.deploy.app``), so one call reaches it.
    """
    from ray import serve

    handle = serve.get_deployment_handle("OpenAIIngress", app_name)
    return handle.drain.remote(timeout_s).result(timeout_s=timeout_s + ABORT_GRACE_S + 30)
