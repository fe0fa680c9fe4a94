"""``EngineReplica`` without Ray: the real Engine on the tiny model, driven by asyncio.

Covers what is hard to provoke over HTTP: an engine failure mid-stream ends the stream with
``Failed(500)`` and the engine serves the next request; closing the stream (client gone) aborts
the request and frees its KV blocks.
"""

import asyncio
import time

import pytest

from cluster.ingress.messages import EngineRequest, Failed, Started
from cluster.replica.replica import EngineReplica
from workers.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def replica(tiny_config):
    return EngineReplica.func_or_class(tiny_config)


def request(max_tokens: int, mode: str | None = None, prompt: str = "Once upon a time") -> EngineRequest:
    return EngineRequest(prompt=prompt, messages=None, sampling=SamplingParams(temperature=0.0),
                         max_tokens=max_tokens, max_tokens_field="max_tokens", mode=mode)


def chat(messages: list[dict], max_tokens: int | None = None, mode: str | None = None) -> EngineRequest:
    return EngineRequest(prompt=None, messages=messages, sampling=SamplingParams(temperature=0.0),
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


def test_a_chat_template_error_is_400_naming_messages(replica):
    """Llama-2 and Mistral templates reject roles that do not alternate with ``raise_exception``."""
    tokenizer = replica.engine.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    try:
        (failed,) = asyncio.run(collect(replica.generate(chat([{"role": "user", "content": "a"}] * 2, 8))))
    finally:
        tokenizer.chat_template = template
    assert failed == Failed(400, "messages: Conversation roles must alternate user/assistant", "messages")
    assert replica.load == 0


def test_a_request_beyond_the_kv_cache_names_the_field_at_fault(tiny_config):
    """A cache of 4 blocks x 16 = 64 slots: max_tokens that overflow it are named, not the prompt
    (the prompt is named when it alone overflows); a default budget is cut to fit."""
    eng = tiny_config.engine.model_copy(update={"num_kv_blocks": 4, "tokens_per_block": 16})
    small = EngineReplica.func_or_class(tiny_config.model_copy(update={"engine": eng}))
    try:
        (failed,) = asyncio.run(collect(small.generate(request(100, "plain"))))
        assert failed.status == 400 and failed.param == "max_tokens"
        assert failed.message.startswith("max_tokens: 100 completion tokens + ") and "the cache holds 64" in failed.message
        assert "req-" not in failed.message
        (failed,) = asyncio.run(collect(small.generate(request(1, "plain", prompt="x" * 100))))
        assert failed.status == 400 and failed.param == "prompt" and "the KV cache holds 64 tokens" in failed.message
        items = asyncio.run(collect(small.generate(chat([{"role": "user", "content": "Hi"}], mode="plain"))))
        last = items[-1]
        assert last.finished and last.prompt_tokens + last.completion_tokens - 1 <= 64
    finally:
        small.async_engine.shutdown()


def wait_until_idle(replica, timeout_s: float = 10.0) -> None:
    """Wait for the engine thread to drain aborts; fail if it does not."""
    deadline = time.monotonic() + timeout_s
    while replica.engine.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert replica.engine.num_unfinished == 0


def all_blocks_free(replica) -> bool:
    blocks = replica.engine.blocks
    return blocks.num_free_blocks == blocks.num_blocks


def test_engine_failure_mid_stream_ends_with_500_and_engine_goes_on(replica, monkeypatch):
    real_run = replica.engine.runner.run
    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real_run(*args)

    monkeypatch.setattr(replica.engine.runner, "run", failing)
    items = asyncio.run(collect(replica.generate(request(32))))
    assert isinstance(items[0], Started) and not items[1].finished
    assert items[-1] == Failed(500, "engine error: RuntimeError: boom")
    assert replica.load == 0 and all_blocks_free(replica)
    monkeypatch.setattr(replica.engine.runner, "run", real_run)
    items = asyncio.run(collect(replica.generate(request(8))))
    assert items[-1].finished and items[-1].completion_tokens >= 1


def test_closing_the_stream_aborts_the_request_and_frees_its_blocks(replica):
    async def run():
        await collect(replica.generate(request(200, "plain")), limit=3)  # Started + 2 deltas, then gone

    asyncio.run(run())
    wait_until_idle(replica)
    assert all_blocks_free(replica)
    assert replica.load == 0


def test_a_path_without_calibration_admits_spec_as_far_as_its_fallback_drafts(tiny_config, tmp_path):
    """Policy auto, but no calibration for this replica's compute path: the engine drafts at
    batch 1 only, and the router's threshold (responses' mode, /health) follows that, not the
    config's spec_max_load."""
    import json

    from cluster.replica.replica import EngineReplica

    other = tmp_path / "cuda.json"
    other.write_text(json.dumps({"compute_path": "cuda", "plain_step_s": {"1": 0.01}, "spec_step_s": {"1:2x3": 0.012},
                                 "tokens_per_step": {"2x3": 2.0}}))
    spec = tiny_config.speculation.model_validate({
        **tiny_config.speculation.model_dump(exclude_unset=True), "policy": "auto", "spec_max_load": 5,
        "by_compute_path": {"cuda": {"calibration": other}}})
    replica = EngineReplica.func_or_class(tiny_config.model_copy(update={"speculation": spec}))
    try:
        assert not replica.per_iteration and replica.spec_cfg.spec_max_load == 1
        stats = replica.stats()
        assert stats["spec_max_load"] == 1 and stats["speculation"] == "2x3<=1, off above"
    finally:
        replica.async_engine.shutdown()


def test_a_forced_spec_where_speculation_is_off_is_plain_and_says_why(tiny_config):
    """A drafter with ``speculation.policy: off`` never drafts (no tree shape, none in the KV cache):
    a request forcing spec is decoded plain and the response says so, instead of claiming spec."""
    spec = tiny_config.speculation.model_copy(update={"policy": "off"})
    off = EngineReplica.func_or_class(tiny_config.model_copy(update={"speculation": spec}))
    try:
        assert off.engine.speculative_available and off.engine.forced_shape is None
        items = asyncio.run(collect(off.generate(request(8, "spec"))))
        assert isinstance(items[0], Started) and items[0].mode == "plain"
        assert items[0].reason == "speculation off (speculation.policy) (requested spec)"
        assert items[-1].finished and items[-1].accepted_draft_tokens == 0
    finally:
        off.async_engine.shutdown()
