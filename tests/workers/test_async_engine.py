"""``AsyncEngine`` builds its engine on the engine thread, which runs every OpenMP region.

libgomp keeps an ICV (thread count) and a worker pool per calling thread. Ray starts actors with
``OMP_NUM_THREADS=1``; an engine built on one thread and stepped on another then ran its kernels
on one core, and a second pool made the workers sleep between regions (the served path ran at
0.5-0.8x the in-process engine). Checked in a fresh interpreter with ``OMP_NUM_THREADS=1``, as in
a Ray actor.
"""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import asyncio, ctypes, sys, threading
    import torch
    from workers.async_engine import AsyncEngine
    from workers.engine_builder import load_engine
    from workers.sampling_params import SamplingParams

    built_on = []
    def build():
        built_on.append(threading.current_thread().name)
        return load_engine(sys.argv[1], None, num_threads=2, max_seq_len=64, num_kv_blocks=64, tokens_per_block=4)

    engine = AsyncEngine(build)
    async def main():
        threads = await engine.call(ctypes.CDLL("libgomp.so.1").omp_get_max_threads)  # OpenMP's own count
        out = [d async for d in engine.generate([5, 6, 7], SamplingParams(max_tokens=4), "plain")]
        return threads, out[-1].completion_tokens
    threads, tokens = asyncio.run(main())
    engine.shutdown()
    print(built_on[0], threads, tokens)
""")


def test_engine_is_built_and_run_on_its_thread_with_its_thread_count(tiny_model_dirs):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dirs["tied_gqa2"])], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    built_on, engine_threads, tokens = proc.stdout.split()
    assert built_on == "engine"
    assert engine_threads == "2"  # the engine's num_threads, not Ray's OMP_NUM_THREADS=1
    assert tokens == "4"


def test_a_failing_build_raises_in_the_constructor():
    import pytest

    from workers.async_engine import AsyncEngine

    def build():
        raise FileNotFoundError("no model here")

    with pytest.raises(FileNotFoundError, match="no model here"):
        AsyncEngine(build)


def test_a_call_cancelled_while_queued_leaves_the_engine_thread_running(tiny_model_dirs):
    """A request cancelled while its tokenization waits for the engine thread (a client that left, a
    timeout) must not stop the thread: its queued call is skipped."""
    import asyncio
    import time

    from workers.async_engine import AsyncEngine
    from workers.engine_builder import load_engine
    from workers.sampling_params import SamplingParams

    engine = AsyncEngine(lambda: load_engine(str(tiny_model_dirs["tied_gqa2"]), None, num_threads=1, max_seq_len=64,
                                        num_kv_blocks=64, tokens_per_block=4))

    async def main():
        engine.call_soon(time.sleep, 0.5)  # the engine thread is busy
        waiting = asyncio.ensure_future(engine.call(engine.engine.encode_prompt, "hello"))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.sleep(0.8)  # the thread reaches the cancelled call
        out = [d async for d in engine.generate([5, 6, 7], SamplingParams(max_tokens=4), "plain")]
        return out[-1].completion_tokens

    try:
        assert asyncio.run(asyncio.wait_for(main(), 60)) == 4
        assert engine.alive
    finally:
        engine.shutdown()


def test_a_dead_engine_thread_fails_requests_in_flight_and_later_ones_at_once(tiny_model_dirs):
    """The engine thread dies outside an iteration (here: ``SystemExit`` from a call run between
    iterations): the stream in flight ends with ``EngineFailure``, and a new request, a new call and a
    call queued behind the fatal one fail at once instead of waiting for a thread that is gone."""
    import asyncio

    import pytest

    from workers.async_engine import AsyncEngine, EngineFailure
    from workers.engine_builder import load_engine
    from workers.sampling_params import SamplingParams

    engine = AsyncEngine(lambda: load_engine(str(tiny_model_dirs["tied_gqa2"]), None, num_threads=1, max_seq_len=256,
                                        num_kv_blocks=64, tokens_per_block=4))

    def die():
        raise SystemExit("killed for the test")

    async def main():
        stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), "plain")
        first = await anext(stream)  # decoding
        fatal = engine.call_soon(die)
        queued = engine.call_soon(lambda: "never")
        with pytest.raises(EngineFailure, match="SystemExit"):
            async for _ in stream:
                pass
        with pytest.raises(EngineFailure, match="engine thread stopped"):
            await asyncio.wrap_future(queued)
        with pytest.raises(EngineFailure):
            await engine.call(engine.engine.encode_prompt, "hello")
        with pytest.raises(EngineFailure):
            await anext(engine.generate([5, 6], SamplingParams(max_tokens=2), "plain"))
        return first, fatal

    first, fatal = asyncio.run(asyncio.wait_for(main(), 60))
    assert first.completion_tokens >= 1 and isinstance(fatal.exception(timeout=10), SystemExit)
    engine._thread.join(10)
    assert not engine.alive and engine.failure is not None


def test_step_time_stat_leaves_prefill_iterations_out(tiny_model_dirs, monkeypatch):
    """``step_s`` (routing stats' step cost) averages generation-only iterations: a slow prompt
    chunk (here made 0.3 s) must not make the replica look slow for the steps after it."""
    import asyncio
    import time

    from workers.async_engine import AsyncEngine
    from workers.engine_builder import load_engine
    from workers.sampling_params import SamplingParams

    engine = AsyncEngine(lambda: load_engine(str(tiny_model_dirs["tied_gqa2"]), None, num_threads=1, max_seq_len=256,
                                        num_kv_blocks=64, tokens_per_block=4))
    real_run = engine.engine.runner.run

    def slow_prefill(context, generation, shape, limits, *rest):
        if context:
            time.sleep(0.3)
        return real_run(context, generation, shape, limits, *rest)

    monkeypatch.setattr(engine.engine.runner, "run", slow_prefill)

    async def main():
        return [d async for d in engine.generate([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True), "plain")]

    out = asyncio.run(asyncio.wait_for(main(), 60))
    engine.shutdown()
    assert out[-1].completion_tokens == 6  # one prefill iteration, then five generation steps were timed
    assert 0 < engine.step_s < 0.1, engine.step_s



def test_a_failing_iteration_leaves_its_finished_requests_to_the_failure_handling(tiny_model_dirs, monkeypatch):
    """An exception while an iteration's results are applied (here: request B's detokenization,
    right after A finished in the same loop) loses that iteration's deltas. A must then still be
    running, so ``AsyncEngine``'s failure handling ends it with B instead of leaving its client
    waiting for a final delta that never comes; afterwards every KV block is free."""
    import pytest

    from workers.async_engine import AsyncEngine, EngineFailure
    from workers.engine_builder import load_engine
    from workers.sampling_params import SamplingParams
    from workers.stopping import OutputStream

    append, a_done = OutputStream.append, []

    def failing_append(self, token_ids):
        if self._params.max_tokens == 50 and a_done:
            raise RuntimeError("decode failed")
        out = append(self, token_ids)
        if self._params.max_tokens == 3 and out.finished:
            a_done.append(True)
        return out

    monkeypatch.setattr(OutputStream, "append", failing_append)
    engine = load_engine(str(tiny_model_dirs["tied_gqa2"]), None, num_threads=1, max_seq_len=128,
                    num_kv_blocks=64, tokens_per_block=4)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), "plain")
    engine.add_request("b", [5, 6, 8], SamplingParams(max_tokens=50, ignore_eos=True), "plain")
    with pytest.raises(RuntimeError, match="decode failed"):
        for _ in range(10):
            engine.step()
    assert a_done, "A did not finish in the failing iteration: the test did not reach its case"
    assert {seq.request_id for seq in engine.scheduler.running} == {"a", "b"}

    # the same through the engine thread: both clients get the failure, nothing hangs, blocks free
    a_done.clear()
    async_engine = AsyncEngine(lambda: load_engine(str(tiny_model_dirs["tied_gqa2"]), None, num_threads=1,
                                              max_seq_len=128, num_kv_blocks=64, tokens_per_block=4))

    async def drain(prompt, max_tokens):
        return [d async for d in async_engine.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                                       "plain")]

    async def main():
        return await asyncio.gather(drain([5, 6, 7], 3), drain([5, 6, 8], 50), return_exceptions=True)

    import asyncio

    try:
        a, b = asyncio.run(asyncio.wait_for(main(), 60))
        assert isinstance(b, EngineFailure) and "decode failed" in str(b)
        assert isinstance(a, EngineFailure) or a[-1].finished
        assert async_engine.engine.num_unfinished == 0
        assert async_engine.engine.blocks.num_free_blocks == async_engine.engine.blocks.num_blocks
    finally:
        async_engine.shutdown()


def test_a_closed_event_loop_drops_its_request_and_the_others_go_on(tiny_model_dirs):
    """A consumer whose event loop closed without ending its request (a worker shutting down) must not
    kill the engine thread: its request is dropped and aborted; a consumer on another loop, and one
    started after, still get every delta, in order."""
    import asyncio

    from workers.async_engine import AsyncEngine
    from workers.engine_builder import load_engine
    from workers.sampling_params import SamplingParams

    engine = AsyncEngine(lambda: load_engine(str(tiny_model_dirs["tied_gqa2"]), None, num_threads=1, max_seq_len=64,
                                             num_kv_blocks=64, tokens_per_block=4))
    try:
        async def start_and_leave():  # take one delta, then the loop closes with the generator still open
            gen = engine.generate([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True), "plain", request_id="ghost")
            await gen.__anext__()
            return gen

        dead = asyncio.new_event_loop()
        left_open = dead.run_until_complete(start_and_leave())
        dead.close()

        async def full(rid):
            return [d async for d in engine.generate([5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True),
                                                     "plain", request_id=rid)]

        async def both():
            return await asyncio.wait_for(asyncio.gather(full("live1"), full("live2")), 60)  # a dead thread hung them

        runs = asyncio.run(both())
        for out in runs:
            assert out[-1].finished and out[-1].completion_tokens == 12
            assert [d.completion_tokens for d in out] == sorted(d.completion_tokens for d in out)
        assert engine.alive and engine.failure is None
        assert "ghost" not in engine._sinks
        assert engine.engine.num_unfinished == 0  # the orphaned request was aborted, not decoded for nobody
        del left_open
    finally:
        engine.shutdown()
