"""Two-pool decision as a plain function: low load speculates, load moves requests to the plain pool."""

from workers.speculation.goodput import StepCosts
from cluster.ingress.pools import PoolLoad, choose_pool

COSTS = StepCosts(plain_s={1: 0.030, 4: 0.040, 8: 0.060, 16: 0.110},
                  spec_s={(2, 2): {1: 0.036, 4: 0.070, 8: 0.140, 16: 0.300}},
                  tokens_per_step={(2, 2): 1.9})


def test_low_load_goes_to_the_speculative_pool():
    pool, reason = choose_pool(COSTS, (2, 2), 1.9, 0, 1, 0, 1)
    assert pool == "spec" and "2x2" in reason and "tau 1.90" in reason


def test_load_fills_both_pools_and_the_spec_pool_stays_lighter():
    load = PoolLoad(COSTS, (2, 2))
    chosen = []
    for _ in range(24):  # a burst: nobody finishes
        pool, _ = load.choose()
        load.started(pool)
        chosen.append(pool)
    assert chosen[0] == "spec" and "plain" in chosen
    assert load.in_flight["plain"] > load.in_flight["spec"] >= 1
    for pool in chosen:
        load.finished(pool)
    assert load.in_flight == {"spec": 0, "plain": 0}
    assert load.choose()[0] == "spec"


def test_low_acceptance_sends_even_the_first_request_to_the_plain_pool():
    assert choose_pool(COSTS, (2, 2), 1.05, 0, 1, 0, 1)[0] == "plain"


def test_more_spec_replicas_take_more_requests():
    one = choose_pool(COSTS, (2, 2), 1.9, 4, 1, 3, 1)[0]
    two = choose_pool(COSTS, (2, 2), 1.9, 4, 2, 3, 1)[0]
    assert (one, two) == ("plain", "spec")


def test_tracked_stream_reports_its_end_exactly_once():
    import asyncio

    from cluster.ingress.pools import TrackedStream

    class Stream:
        def __init__(self, items):
            self.items, self.cancelled = list(items), False

        async def __anext__(self):
            if not self.items:
                raise StopAsyncIteration
            item = self.items.pop(0)
            if isinstance(item, Exception):
                raise item
            return item

        def cancel(self):
            self.cancelled = True

    ends = []

    async def consume(stream):
        return [x async for x in stream]

    s = TrackedStream(Stream([1, 2]), lambda: ends.append("a"))
    assert asyncio.run(consume(s)) == [1, 2] and ends == ["a"]
    s = TrackedStream(Stream([1, RuntimeError("x")]), lambda: ends.append("b"))
    try:
        asyncio.run(consume(s))
    except RuntimeError:
        pass
    assert ends == ["a", "b"]
    inner = Stream([1, 2])
    s = TrackedStream(inner, lambda: ends.append("c"))
    s.cancel()
    s.cancel()
    del s
    assert inner.cancelled and ends == ["a", "b", "c"]
    TrackedStream(Stream([1]), lambda: ends.append("d"))  # dropped unread
    assert ends[-1] == "d"
