"""Asynchronous engine API: submit a request, stream its deltas, abort it by closing the stream.

The :class:`~workers.engine.Engine` is synchronous and not thread-safe, so one background thread owns
it. That thread also *builds* it, and is the only thread of the process that runs the model: the
OpenMP runtime (libgomp, shared by torch and our kernels) keeps one worker pool per calling thread,
and with a second pool alive (say, the main thread loaded the model) it counts more threads than
cores, so its workers stop spin-waiting and sleep on a futex between the hundreds of small parallel
regions of each step: measured, about 300 context switches per token and 10-30% slower decoding
(``benchmarks/served_vs_engine.py``). OpenMP's thread count is per calling thread too, so Ray's
``OMP_NUM_THREADS=1`` for actors would otherwise leave the engine thread on one core.

The engine thread drains submitted commands (new requests, aborts, calls such as tokenization) between
iterations and runs :meth:`Engine.step` while any request is unfinished. asyncio callers receive
their deltas through per-request queues. A request whose consumer stops early (a client that
disconnected) is aborted, and its KV blocks are free at the next iteration. An exception inside an
iteration fails every request then in flight with that error (none hangs) and the engine goes on
with new requests. If the thread itself dies (an error outside an iteration, ``SystemExit``...), every
request in flight and every later one fails at once with :class:`EngineFailure` (``failure`` says why).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

from workers.engine import Engine
from workers.outputs import GenerationDelta
from workers.sampling_params import SamplingParams

log = logging.getLogger(__name__)


MIN_PREFILL_SAMPLE = 32
"""Prompt positions an iteration must compute to count in ``prefill_s_per_token`` (a short chunk's time is
mostly the decode rows beside it)."""


class EngineFailure(RuntimeError):
    """An iteration failed; every request in flight gets this error."""


class AsyncEngine:
    """Builds an :class:`Engine` with ``build()`` on a background thread and runs it there.

    The constructor returns once the engine is built.

    Raises:
        Exception: whatever ``build()`` raised (the thread has then ended).
    """

    def __init__(self, build: Callable[[], Engine]):
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self.failure: EngineFailure | None = None  # set when the engine thread died; then nothing runs
        self.step_s = 0.0  # moving average of seconds per generation-only iteration (weight 0.1), for routing
        # stats: an iteration that also prefills a prompt chunk costs many decode steps and would make a replica
        # that just admitted a request look several times slower than its peers
        self.prefill_s_per_token = 0.0  # moving average of an iteration's seconds per prompt position it
        # computed (weight 0.1), over iterations with at least MIN_PREFILL_SAMPLE of them: the router's price
        # of the prefill a cached prefix saves
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="engine", daemon=True)
        self._thread.start()
        self.engine: Engine = built.result()

    @property
    def alive(self) -> bool:
        """The engine thread is running (False after :meth:`shutdown` or a crash outside an iteration)."""
        return self._thread.is_alive()

    async def call(self, fn: Callable, *args):
        """Run ``fn(*args)`` on the engine thread between iterations (tokenizer, engine queries).

        Raises:
            EngineFailure: the engine thread has died.
        """
        return await asyncio.wrap_future(self.call_soon(fn, *args))

    def call_soon(self, fn: Callable, *args) -> Future:
        """Queue ``fn(*args)`` for the engine thread (between iterations) without waiting; its result's
        Future (failed with :class:`EngineFailure` if the engine thread has died)."""
        future: Future = Future()
        self._submit(("call", fn, args, future))
        return future

    async def generate(self, prompt_ids: list[int], params: SamplingParams, mode: str,
                       request_id: str | None = None, force_draft: bool = False) -> AsyncIterator[GenerationDelta]:
        """Stream the request's deltas, the last one finished (``force_draft``: see :meth:`Engine.add_request`).

        Raises:
            ValueError: the engine rejected the request (see :meth:`Engine.add_request`).
            EngineFailure: an iteration failed while the request was in flight, or the engine thread died.
        """
        rid = request_id or f"req-{next(self._ids)}"
        sink: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        if rid in self._sinks:
            raise ValueError(f"request id {rid!r} is in use")
        self._sinks[rid] = (loop, sink)  # before the check below: a thread dying meanwhile fails this sink
        if self.failure is not None:
            self._sinks.pop(rid, None)
            raise self.failure
        self._submit(("add", rid, list(prompt_ids), params, mode, force_draft))
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._sinks.pop(rid, None)
            if not finished:
                self._submit(("abort", rid))

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.engine.close()

    def _submit(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()
        if self.failure is not None:  # nobody will run it: answer it here
            self._reject_commands()

    def _deliver(self, rid: str, item) -> None:
        target = self._sinks.get(rid)
        if target is not None:
            loop, sink = target
            try:
                loop.call_soon_threadsafe(sink.put_nowait, item)
            except RuntimeError:  # its event loop was closed: nobody will read it
                self._orphaned([rid])

    def _deliver_all(self, deltas) -> None:
        """Hand each delta to its request's consumer: one wake-up per event loop for the whole
        iteration (a batch-16 step woke the serving loop 16 times, taking a core from the kernels'
        threads each time on a small machine), each sink's items in order."""
        by_loop: dict = {}
        for d in deltas:
            target = self._sinks.get(d.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], d))
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, pairs)
            except RuntimeError:  # that event loop was closed: its consumers are gone, the others still get theirs
                self._orphaned([r for r, (lp, _) in self._sinks.items() if lp is loop])

    def _orphaned(self, rids: list[str]) -> None:
        """On the engine thread: requests whose consumer's event loop closed without ending them (a
        worker shutting down) are dropped and aborted, so the thread neither dies on them nor decodes
        them for nobody."""
        for rid in rids:
            self._sinks.pop(rid, None)
            engine = getattr(self, "engine", None)
            if engine is not None:
                engine.abort(rid)

    def _queued(self):
        """The queued commands, oldest first, each taken off the queue as it is yielded."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain(self) -> None:
        for command in self._queued():
            kind = command[0]
            if kind == "add":
                _, rid, prompt_ids, params, mode, force_draft = command
                if rid not in self._sinks:  # the consumer already left
                    continue
                try:
                    self.engine.add_request(rid, prompt_ids, params, mode, force_draft)
                except ValueError as err:
                    self._deliver(rid, err)
            elif kind == "abort":
                self.engine.abort(command[1])
            else:
                _, fn, args, future = command
                if not future.set_running_or_notify_cancel():  # the caller left (a cancelled request)
                    continue
                try:
                    future.set_result(fn(*args))
                except BaseException as err:  # handed to the caller; SystemExit and the like end the thread too
                    future.set_exception(err)
                    if not isinstance(err, Exception):
                        raise

    def _run(self, build: Callable[[], Engine], built: Future) -> None:
        try:
            engine = build()
        except BaseException as err:  # handed to the constructor
            built.set_exception(err)
            return
        self.engine = engine
        built.set_result(engine)
        reason = "the engine was shut down"
        try:
            self._loop()
        except BaseException as err:
            log.exception("the engine thread stopped")
            reason = f"the engine thread stopped ({type(err).__name__}: {err})"
            raise
        finally:  # the thread is ending: nothing may wait for it
            self.failure = EngineFailure(f"engine error: {reason}")
            for rid in list(self._sinks):
                self._deliver(rid, self.failure)
            self._reject_commands()

    def _reject_commands(self) -> None:
        """After the thread died: fail every queued call (an ``add``'s sink was failed already)."""
        for command in self._queued():
            if command[0] == "call" and command[3].set_running_or_notify_cancel():
                command[3].set_exception(self.failure)

    def _loop(self) -> None:
        while not self._stopped:
            self._drain()
            if not self.engine.num_unfinished:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                t0 = time.perf_counter()
                deltas = self.engine.step()
                dt = time.perf_counter() - t0
                if deltas and not self.engine.last_context_requests:
                    self.step_s = dt if not self.step_s else 0.9 * self.step_s + 0.1 * dt
                elif self.engine.last_context_tokens >= MIN_PREFILL_SAMPLE:
                    per_token = dt / self.engine.last_context_tokens
                    self.prefill_s_per_token = per_token if not self.prefill_s_per_token else \
                        0.9 * self.prefill_s_per_token + 0.1 * per_token
            except Exception as err:
                log.exception("engine iteration failed")
                self._fail_all(EngineFailure(f"engine error: {type(err).__name__}: {err}"))
                continue
            self._deliver_all(deltas)

    def _fail_all(self, err: EngineFailure) -> None:
        for rid in self.engine.abort_all():
            self._deliver(rid, err)


def _put_all(pairs: list) -> None:
    """On the consumers' event loop: each ``(sink, item)`` into its sink, in order."""
    for sink, item in pairs:
        sink.put_nowait(item)
