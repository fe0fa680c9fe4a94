"""Concurrent requests over HTTP: decoded together by in-flight batching, and shed with 503 when
Serve's queue is full."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from ray import serve

from cluster.app import deploy

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
        assert t["usage"] == s["usage"]
        assert t["rdserve"]["mode"] == s["rdserve"]["mode"]


@pytest.fixture
def tight_app(base_url, tiny_config):
    """The tiny model behind a replica that admits 1 request and queues 1 more."""
    cfg = tiny_config.model_copy(update={"serve": tiny_config.serve.model_copy(
        update={"max_ongoing_requests": 1, "max_queued_requests": 1})})
    deploy(cfg, name="tight", route_prefix="/tight")
    yield f"{base_url}/tight"
    serve.delete("tight")


def test_full_queue_answers_503_and_the_rest_complete(tight_app):
    bodies = [{**body(i, "plain"), "max_tokens": 150} for i in range(6)]
    responses = asyncio.run(post_all(tight_app, "/v1/completions", bodies))
    codes = sorted(r.status_code for r in responses)
    assert 503 in codes and 200 in codes and set(codes) <= {200, 503}, codes
    shed = next(r for r in responses if r.status_code == 503).json()["error"]
    assert "overloaded" in shed["message"] and shed["type"] == "server_error"
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] >= 1
