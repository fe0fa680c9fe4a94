"""The in-process engine client (``serve.colocate``): Serve-like admission, and every way a stream ends
gives its slot back and closes the replica's generator (which is what aborts the request in the engine)."""

from __future__ import annotations

import asyncio

import pytest
from ray.serve.exceptions import BackPressureError

from cluster.ingress.clients import InProcessClient
from cluster.ingress.limits import Interrupted, RequestGuard


class FakeReplica:
    """``generate`` yields ``n`` items, each after ``gate`` is set (or at once); records what ran."""

    def __init__(self):
        self.started: list[str] = []
        self.closed: list[str] = []
        self.gate: asyncio.Event | None = None

    async def generate(self, req):
        name, n = req
        self.started.append(name)
        try:
            for i in range(n):
                if self.gate is not None:
                    await self.gate.wait()
                yield f"{name}:{i}"
        finally:
            self.closed.append(name)

    def stats(self) -> dict:
        return {"load": len(self.started) - len(self.closed)}


async def drain(stream) -> list:
    return [item async for item in stream]


def test_streams_items_and_frees_the_slot_at_the_end():
    async def run():
        replica = FakeReplica()
        client = InProcessClient(replica, "OpenAIIngress", max_ongoing_requests=1, max_queued_requests=None)
        first = await drain(client.stream(("a", 3)))
        second = await asyncio.wait_for(drain(client.stream(("b", 2))), 1.0)  # needs the slot "a" held
        return first, second, replica.closed, await client.stats()

    first, second, closed, stats = asyncio.run(run())
    assert first == ["a:0", "a:1", "a:2"] and second == ["b:0", "b:1"]
    assert closed == ["a", "b"] and stats == {"load": 0, "queued": 0}


def test_at_most_max_ongoing_in_the_engine_the_rest_wait_in_order_then_503():
    async def run():
        replica = FakeReplica()
        replica.gate = asyncio.Event()
        client = InProcessClient(replica, "x", max_ongoing_requests=2, max_queued_requests=2)
        streams = [client.stream((name, 1)) for name in "abcde"]
        tasks = [asyncio.ensure_future(drain(s)) for s in streams[:4]]
        await asyncio.sleep(0.01)
        in_engine = list(replica.started)
        with pytest.raises(BackPressureError):  # 2 in the engine, 2 waiting: the fifth is refused
            await anext(streams[4])
        replica.gate.set()
        return in_engine, await asyncio.gather(*tasks), replica.started

    in_engine, results, started = asyncio.run(run())
    assert in_engine == ["a", "b"]
    assert results == [["a:0"], ["b:0"], ["c:0"], ["d:0"]] and started == ["a", "b", "c", "d"]


def test_cancel_closes_the_generator_and_frees_the_slot():
    async def run():
        replica = FakeReplica()
        client = InProcessClient(replica, "x", max_ongoing_requests=1, max_queued_requests=None)
        stream = client.stream(("a", 100))
        assert await anext(stream) == "a:0"
        stream.cancel()
        await asyncio.sleep(0)  # the close runs on the loop
        closed = list(replica.closed)
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return closed, await asyncio.wait_for(drain(client.stream(("b", 1))), 1.0)

    closed, after = asyncio.run(run())
    assert closed == ["a"] and after == ["b:0"]


def test_a_deadline_while_waiting_for_an_item_ends_the_request_in_the_engine():
    """The ingress's guard cancels the wait at the request's deadline: the replica's generator is
    closed through the cancellation (its cleanup aborts the engine request), the slot is free."""

    async def run():
        replica = FakeReplica()
        replica.gate = asyncio.Event()  # never set: the engine "stalls"
        client = InProcessClient(replica, "x", max_ongoing_requests=1, max_queued_requests=None)
        guard = RequestGuard(timeout_s=0.05)
        stream = client.stream(("a", 2))
        with pytest.raises(Interrupted):
            await guard.next(stream)
        stream.cancel()  # what the ingress does next: a no-op here
        replica.gate.set()
        return list(replica.closed), await asyncio.wait_for(drain(client.stream(("b", 1))), 1.0)

    closed, after = asyncio.run(run())
    assert closed == ["a"] and after == ["b:0"]


def test_a_deadline_while_queued_leaves_the_queue_count_right():
    async def run():
        replica = FakeReplica()
        replica.gate = asyncio.Event()
        client = InProcessClient(replica, "x", max_ongoing_requests=1, max_queued_requests=1)
        holder = asyncio.ensure_future(drain(client.stream(("a", 1))))
        await asyncio.sleep(0.01)
        guard = RequestGuard(timeout_s=0.05)
        queued = client.stream(("b", 1))
        with pytest.raises(Interrupted):
            await guard.next(queued)  # timed out in the queue, never reached the engine
        waiting_after = client.waiting
        third = asyncio.ensure_future(drain(client.stream(("c", 1))))  # the queue has room again
        await asyncio.sleep(0.01)
        replica.gate.set()
        return waiting_after, await holder, await third, replica.started

    waiting_after, a, c, started = asyncio.run(run())
    assert waiting_after == 0 and a == ["a:0"] and c == ["c:0"] and started == ["a", "c"]


def test_a_dropped_stream_gives_its_slot_back():
    async def run():
        replica = FakeReplica()
        client = InProcessClient(replica, "x", max_ongoing_requests=1, max_queued_requests=None)
        stream = client.stream(("a", 5))
        await anext(stream)
        del stream  # an abandoned response: no end, no cancel
        return await asyncio.wait_for(drain(client.stream(("b", 1))), 1.0)

    assert asyncio.run(run()) == ["b:0"]


async def _next_or_end(stream):
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return "end"


def test_cancel_from_another_task_holds_the_slot_until_the_running_wait_returns():
    """cancel() while another task waits inside the replica's generator: the slot is not handed on
    (the request is still in the engine); the wait then ends the stream and frees it."""

    async def run():
        replica = FakeReplica()
        replica.gate = asyncio.Event()
        client = InProcessClient(replica, "x", max_ongoing_requests=1, max_queued_requests=None)
        stream = client.stream(("a", 5))
        waiting = asyncio.ensure_future(_next_or_end(stream))
        await asyncio.sleep(0.01)  # inside the generator, at the gate
        stream.cancel()
        other = asyncio.ensure_future(drain(client.stream(("b", 1))))
        await asyncio.sleep(0.02)
        b_ran_early = other.done() or "b" in replica.started
        replica.gate.set()
        return b_ran_early, await waiting, list(replica.closed), await asyncio.wait_for(other, 1.0)

    b_ran_early, ended, closed, b = asyncio.run(run())
    assert not b_ran_early and ended == "end" and closed[0] == "a" and b == ["b:0"]


def test_cancel_while_queued_never_reaches_the_engine():
    async def run():
        replica = FakeReplica()
        replica.gate = asyncio.Event()
        client = InProcessClient(replica, "x", max_ongoing_requests=1, max_queued_requests=None)
        holder = asyncio.ensure_future(drain(client.stream(("a", 1))))
        await asyncio.sleep(0.01)
        queued = client.stream(("b", 1))
        waiting = asyncio.ensure_future(_next_or_end(queued))
        await asyncio.sleep(0.01)
        queued.cancel()  # from this task, while the other waits for a slot
        replica.gate.set()
        return await holder, await waiting, await asyncio.wait_for(drain(client.stream(("c", 1))), 1.0), replica.started

    a, b, c, started = asyncio.run(run())
    assert a == ["a:0"] and b == "end" and c == ["c:0"] and started == ["a", "c"]


def test_stats_add_the_requests_waiting_for_a_slot():
    async def run():
        replica = FakeReplica()
        replica.gate = asyncio.Event()
        client = InProcessClient(replica, "x", max_ongoing_requests=1, max_queued_requests=None)
        tasks = [asyncio.ensure_future(drain(client.stream((n, 1)))) for n in "abc"]
        await asyncio.sleep(0.01)
        stats = await client.stats()
        replica.gate.set()
        await asyncio.gather(*tasks)
        return stats, await client.stats()

    during, after = asyncio.run(run())
    assert during == {"load": 1, "queued": 2} and after == {"load": 0, "queued": 0}
