"""Request deadlines, the completion rate behind Retry-After, and drain bookkeeping, without Ray."""

import asyncio

import pytest

from cluster.ingress.drain import Admission
from cluster.ingress.limits import CompletionRate, Interrupted, RequestGuard, retry_after_s


def test_retry_after_is_the_queue_over_the_drain_rate_within_bounds():
    assert retry_after_s(waiting=9, completed_per_s=2.0) == 5  # 10 requests ahead at 2/s
    assert retry_after_s(waiting=0, completed_per_s=100.0) == 1  # at least 1 s
    assert retry_after_s(waiting=1000, completed_per_s=1.0) == 10  # at most 10 s
    assert retry_after_s(waiting=3, completed_per_s=0.0) == 10  # nothing completing


def test_completion_rate_over_a_sliding_window():
    now = [100.0]
    rate = CompletionRate(window_s=10.0, clock=lambda: now[0])
    assert rate.per_s() == 0.0
    for _ in range(4):
        rate.record()
        now[0] += 0.5
    assert rate.per_s() == pytest.approx(4 / 2.0)  # 4 over the 2 s since the oldest
    now[0] += 20  # all out of the window
    assert rate.per_s() == 0.0


async def _slow_stream(delays):
    for d in delays:
        await asyncio.sleep(d)
        yield d


def test_guard_times_out_a_stalled_stream():
    async def run():
        guard = RequestGuard(timeout_s=0.3)
        got = []
        with pytest.raises(Interrupted) as err:
            async for item in guard.items(_slow_stream([0.01, 0.01, 5.0])):
                got.append(item)
        return got, err.value, guard.started

    got, err, started = asyncio.run(run())
    assert got == [0.01, 0.01] and started
    assert err.reason == "timeout" and "serve.request_timeout_s" in err.message


def test_guard_abort_ends_the_current_wait_and_drain_reports_it():
    async def run():
        admission = Admission(request_timeout_s=None)
        guard = admission.admit()
        reasons = []

        async def consume():
            try:
                async for _ in guard.items(_slow_stream([0.01, 60.0])):
                    pass
            except Interrupted as err:
                reasons.append(err.reason)
            finally:
                admission.done(guard)

        task = asyncio.ensure_future(consume())
        report = await admission.drain(timeout_s=0.3, poll_s=0.05)
        await task
        return report, reasons, admission.admit(), admission.retry_after()

    report, reasons, late, retry_after = asyncio.run(run())
    assert reasons == ["shutdown"] and report["aborted"] == 1 and report["finished"] == 0
    assert late is None and 1 <= retry_after <= 10  # draining: no admission, 503 with Retry-After


def test_drain_waits_for_requests_that_finish_in_time():
    async def run():
        admission = Admission(request_timeout_s=5.0)
        guard = admission.admit()

        async def consume():
            async for _ in guard.items(_slow_stream([0.05, 0.05])):
                pass
            admission.done(guard)

        task = asyncio.ensure_future(consume())
        report = await admission.drain(timeout_s=10.0, poll_s=0.02)
        await task
        return report

    report = asyncio.run(run())
    assert report["finished"] == 1 and report["aborted"] == 0 and report["drain_s"] < 5


def test_rejected_requests_do_not_count_as_completions_in_retry_after():
    """A burst of 503s (requests that never left the queue) must not raise the drain rate: Retry-After
    would otherwise shrink to 1 s exactly when the queue is full."""
    async def run():
        admission = Admission(request_timeout_s=None)
        for _ in range(20):  # rejected: their guard never got a stream item
            admission.done(admission.admit())
        rejected_only = admission.retry_after()
        served = admission.admit()
        await served.next(_slow_stream([0.0]))  # its first item arrived: it left the queue
        admission.done(served)
        return rejected_only, admission.completed.per_s()

    rejected_only, rate = asyncio.run(run())
    assert rejected_only == 10  # nothing completed: the upper bound
    assert rate == pytest.approx(1.0)  # the one served request, over the 1 s minimum span
