"""Concurrent requests over HTTP: decoded together by in-flight batching, and shed with 503 when
Serve's queue is full."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from ray import serve

from cluster.deploy.app import deploy, engine_deployment_name

MODEL_NAME = "tiny-llama"


def body(i: int, mode: str) -> dict:
    return {"model": MODEL_NAME, "prompt": f"Request {i}: once upon a time", "max_tokens": 40 + i,
            "temperature": 0, "rdserve": {"mode": mode}}


async def post_all(base_url: str, path: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        return await asyncio.gather(*(client.post(path, json=b) for b in bodies))


def test_concurrent_requests_get_their_solo_outputs(base_url, http):
    bodies = [body(i, "spec" if i % 2 else "plain") for i in range(8)]
    solo = [http.post("/v1/completions", json=b).json() for b in bodies]
    together = [r.json() for r in asyncio.run(post_all(base_url, "/v1/completions", bodies))]
    for s, t in zip(solo, together):
        assert t["choices"][0]["text"] == s["choices"][0]["text"]
        assert counts(t["usage"]) == counts(s["usage"])  # cached_tokens depends on the order
        assert t["rdserve"]["mode"] == s["rdserve"]["mode"]


@pytest.fixture(scope="module", params=[True, False], ids=["colocated", "separate"])
def tight_app(request, base_url, tiny_config):
    """The tiny model behind a replica that admits 1 request and queues 1 more: in the ingress's process
    (the limits are the in-process client's) and as its own deployment (Serve's); ``(url, the engine's
    deployment)``."""
    cfg = tiny_config.model_copy(update={"serve": tiny_config.serve.model_copy(
        update={"max_ongoing_requests": 1, "max_queued_requests": 1, "colocate": request.param})})
    deploy(cfg, name="tight", route_prefix="/tight")
    yield f"{base_url}/tight", engine_deployment_name(cfg)
    serve.delete("tight")


def test_full_queue_answers_503_and_the_rest_complete(tight_app):
    tight_app, _ = tight_app
    bodies = [{**body(i, "plain"), "max_tokens": 150} for i in range(6)]
    responses = asyncio.run(post_all(tight_app, "/v1/completions", bodies))
    codes = sorted(r.status_code for r in responses)
    assert 503 in codes and 200 in codes and set(codes) <= {200, 503}, codes
    shed_resp = next(r for r in responses if r.status_code == 503)
    shed = shed_resp.json()["error"]
    assert "overloaded" in shed["message"] and shed["type"] == "server_error"
    assert 1 <= int(shed_resp.headers["retry-after"]) <= 10  # seconds, from the drain rate (cluster.ingress.limits)
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] >= 1


def test_openai_client_retries_a_503_after_retry_after(tight_app):
    """With the engine stalled, two requests fill the tight replica and its queue; the openai client's
    request gets 503 with Retry-After, waits that long each time, and a retry succeeds."""
    import threading
    import time

    import openai

    tight_app, engine = tight_app
    assert httpx.post(f"{tight_app}/v1/completions", json=body(0, "plain"), timeout=60).status_code == 200
    serve.get_deployment_handle(engine, "tight").stall_engine_for_test.remote(6.0).result()
    seen = []
    hook = lambda r: seen.append((time.monotonic(), r.status_code, r.headers.get("retry-after")))  # noqa: E731
    client = openai.OpenAI(base_url=f"{tight_app}/v1", api_key="unused", max_retries=5,
                           http_client=httpx.Client(event_hooks={"response": [hook]}, timeout=120))
    fillers = [threading.Thread(target=httpx.post, args=(f"{tight_app}/v1/completions",),
                                kwargs={"json": body(i, "plain"), "timeout": 120}) for i in range(2)]
    for t in fillers:  # one admitted by the replica, one in Serve's queue (the stalled engine holds both)
        t.start()
        time.sleep(0.5)  # (the tight replica's /health would queue behind them, so it cannot be polled)
    text = client.completions.create(model=MODEL_NAME, prompt="retry me", max_tokens=4)
    for t in fillers:
        t.join()
    assert text.usage.completion_tokens >= 1
    assert seen[0][1] == 503 and seen[-1][1] == 200, seen
    for (t0, status, retry_after), (t1, _, _) in zip(seen, seen[1:]):
        assert status == 503 and 1 <= int(retry_after) <= 10
        assert t1 - t0 >= int(retry_after) - 0.2, seen  # the client waited as told


def counts(usage: dict) -> dict:
    """Token counts of a usage object, less ``prompt_tokens_details`` (the prefix cache's hits depend on
    which request came first)."""
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
