"""``EngineReplica`` without Ray: the real Engine on the tiny model, driven by asyncio.

Covers what is hard to provoke over HTTP: an engine failure mid-stream ends the stream with
``Failed(500)``, and closing the stream (client gone) closes the engine's generator.
"""

import asyncio

import pytest

from cluster.replica import EngineReplica, EngineRequest, Failed, Started
from workers.sampling import SamplingParams


@pytest.fixture(scope="module")
def replica(tiny_config):
    return EngineReplica.func_or_class(tiny_config)


def request(max_tokens: int, mode: str | None = None, prompt: str = "Once upon a time") -> EngineRequest:
    return EngineRequest(prompt=prompt, messages=None, sampling=SamplingParams(temperature=0.0),
                         max_tokens=max_tokens, max_tokens_field="max_tokens", mode=mode)


async def collect(stream, limit: int | None = None) -> list:
    items = []
    async for item in stream:
        items.append(item)
        if limit is not None and len(items) == limit:
            break
    await stream.aclose()
    return items


def test_stream_is_started_then_deltas_ending_finished(replica):
    items = asyncio.run(collect(replica.generate(request(8, "spec"))))
    assert isinstance(items[0], Started) and items[0].mode == "spec" and items[0].reason == "requested spec"
    assert items[-1].finished and not any(d.finished for d in items[1:-1])
    assert items[-1].completion_tokens == sum(len(d.token_ids) for d in items[1:]) <= 8
    assert replica.load == 0


def test_empty_prompt_is_rejected_as_400(replica):
    (failed,) = asyncio.run(collect(replica.generate(request(8, prompt=""))))
    assert failed == Failed(400, "prompt: the prompt is empty (0 tokens)", "prompt")


def test_engine_failure_mid_stream_ends_with_500(replica, monkeypatch):
    real_generate = replica.engine.generate

    def failing(*args):
        yield next(real_generate(*args))
        raise RuntimeError("boom")

    monkeypatch.setattr(replica.engine, "generate", failing)
    items = asyncio.run(collect(replica.generate(request(32))))
    assert isinstance(items[0], Started) and not items[1].finished
    assert items[-1] == Failed(500, "engine error: RuntimeError: boom")
    assert replica.load == 0


def test_closing_the_stream_closes_the_engine_generator(replica, monkeypatch):
    real_generate = replica.engine.generate
    steps_run, closed = [], []

    def tracked(*args):
        try:
            for delta in real_generate(*args):
                steps_run.append(delta)
                yield delta
        finally:
            closed.append(True)

    monkeypatch.setattr(replica.engine, "generate", tracked)

    async def run():
        await collect(replica.generate(request(200, "plain")), limit=3)  # Started + 2 deltas, then gone
        await asyncio.get_running_loop().run_in_executor(replica._thread, lambda: None)  # drain the engine thread

    asyncio.run(run())
    assert closed == [True] and len(steps_run) < 10
    assert replica.load == 0
