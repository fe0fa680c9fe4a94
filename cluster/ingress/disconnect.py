"""Client disconnects as plain ASGI disconnects, so a cancelled request ends quietly.

Behind Serve's HTTP proxy, a client that goes away makes the proxy cancel the replica's task; the
replica's ASGI ``receive()`` then raises ``ray.exceptions.TaskCancelledError`` instead of returning
``{"type": "http.disconnect"}``. Starlette's streaming response lets that exception escape, and Ray
logs it as "Future exception was never retrieved ... TaskCancelledError". This middleware turns any
exception from ``receive()`` into the disconnect message the ASGI spec defines, so the response is
cancelled the ordinary way (the ingress logs one INFO line with the request's id).
"""

from __future__ import annotations

import logging
import logging.handlers

from ray.exceptions import TaskCancelledError

DISCONNECT = {"type": "http.disconnect"}


class QuietDisconnect:
    """Pure ASGI middleware (no wrapping of what is sent). Only Ray's ``TaskCancelledError`` becomes a
    disconnect: any other failure of ``receive()`` is not evidence that the client left, and turning it
    into one would cut a healthy stream short."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def receive_or_disconnect():
            try:
                return await receive()
            except TaskCancelledError:  # the proxy cancelled the request: its client is gone
                return DISCONNECT

        await self.app(scope, receive_or_disconnect, send)


def info_now(logger: logging.Logger, message: str, *args) -> None:
    """Log ``message % args`` at INFO and flush the buffering handlers on the way to the root.

    Serve's throughput mode (``RAY_SERVE_THROUGHPUT_OPTIMIZED``, set by ``cluster.deploy.app.SERVE_ENV``)
    buffers a replica's log records in a ``logging.handlers.MemoryHandler`` of 1,000 records that
    flushes only when full or on ERROR, so a rare line (a cancelled, timed-out or drained request)
    would reach the replica's log file much later, or never if the replica stops first.
    """
    logger.info(message, *args)
    node: logging.Logger | None = logger
    while node is not None:
        for handler in node.handlers:
            if isinstance(handler, logging.handlers.MemoryHandler):
                handler.flush()
        node = node.parent if node.propagate else None
