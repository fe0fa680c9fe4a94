"""Time and load limits at the ingress: per-request deadlines, the queue drain rate and ``Retry-After``.

A request's deadline (``serve.request_timeout_s``) bounds every wait for its next stream item, not
the time spent sending to a slow client. When it passes, the wait is cancelled; the ingress then
cancels the request's Serve stream, which aborts it in the engine (its KV blocks are free at the
next iteration) and answers 504 (nothing sent yet) or an error event (streaming).
The same switch ends a request early when a drain runs out of time (:mod:`cluster.ingress.drain`).

``Retry-After`` (RFC 9110 Sec. 10.2.3, seconds) on a 503: the time the requests ahead need to
complete at the rate requests have been completing, bounded to
[``RETRY_AFTER_MIN_S``, ``RETRY_AFTER_MAX_S``]. The ``openai`` client waits that long before its
retry (it honours values up to 60 s).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 10
RATE_WINDOW_S = 30.0


def retry_after_s(waiting: int, completed_per_s: float, low: int = RETRY_AFTER_MIN_S,
                  high: int = RETRY_AFTER_MAX_S) -> int:
    """Seconds until a retry is likely admitted: ``ceil((waiting + 1) / completed_per_s)`` within
    ``[low, high]``; ``high`` when nothing has been completing."""
    if completed_per_s <= 0:
        return high
    return int(min(high, max(low, math.ceil((waiting + 1) / completed_per_s))))


class CompletionRate:
    """Requests completed per second over the last ``window_s`` seconds (the queue's drain rate).

    With completions spread over less than the window, the rate is over the time since the oldest
    one (at least ``min_span_s``), so a fresh server is not underestimated.
    """

    def __init__(self, window_s: float = RATE_WINDOW_S, min_span_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.window_s, self.min_span_s, self.clock = window_s, min_span_s, clock
        self._times: deque[float] = deque()

    def record(self) -> None:
        self._times.append(self.clock())
        self._prune()

    def per_s(self) -> float:
        self._prune()
        if not self._times:
            return 0.0
        return len(self._times) / max(self.min_span_s, self.clock() - self._times[0])

    def _prune(self) -> None:
        cutoff = self.clock() - self.window_s
        while self._times and self._times[0] < cutoff:
            self._times.popleft()


class Interrupted(Exception):
    """A request ended by its guard: ``reason`` is ``"timeout"`` or ``"shutdown"``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class RequestGuard:
    """One request's deadline and abort switch; :meth:`next` waits for a stream item under them.

    ``timeout_s``: the request's time limit in seconds (None: none). Create it on the event loop.
    """

    def __init__(self, timeout_s: float | None):
        self.loop = asyncio.get_running_loop()
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else self.loop.time() + timeout_s
        self.started = False  # an item arrived (the request left the queue)
        self._reason: str | None = None
        self._waiting: asyncio.Timeout | None = None

    async def next(self, stream: AsyncIterator):
        """The stream's next item.

        Raises:
            StopAsyncIteration: the stream ended.
            Interrupted: the deadline passed (``"timeout"``) or :meth:`abort` was called.
        """
        if self._reason is not None:
            raise self._interrupted()
        try:
            async with asyncio.timeout_at(self.deadline) as waiting:
                self._waiting = waiting
                item = await anext(stream)
        except TimeoutError:
            self._reason = self._reason or "timeout"
            raise self._interrupted() from None
        finally:
            self._waiting = None
        self.started = True
        return item

    def items(self, stream: AsyncIterator) -> AsyncIterator:
        """``async for`` over the stream's items, each awaited with :meth:`next`."""
        return _Guarded(self, stream)

    def abort(self, reason: str = "shutdown") -> None:
        """End the request at its current (or next) wait with :class:`Interrupted` ``reason``."""
        self._reason = self._reason or reason
        if self._waiting is not None:
            self._waiting.reschedule(self.loop.time())

    def _interrupted(self) -> Interrupted:
        if self._reason == "timeout":
            return Interrupted("timeout", f"request timed out after {self.timeout_s:g} s "
                                          "(serve.request_timeout_s); its generation was aborted")
        return Interrupted(self._reason, "the server is shutting down: the request did not finish within "
                                         "serve.drain_timeout_s and was aborted")


class _Guarded:
    def __init__(self, guard: RequestGuard, stream: AsyncIterator):
        self.guard, self.stream = guard, stream

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.guard.next(self.stream)
