"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis + hypothesis).

Positive and negative examples for every operation, sent over real HTTP to an app of the tiny model
(context 64 tokens, so valid requests decode quickly). Every response: no 5xx; every 4xx carries an
OpenAI error whose message names a field (``field: ...``, or the ``Authorization``/``model`` subject).
Afterwards: at least ``MIN_REQUESTS`` were sent, the server is healthy and every KV block is free.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from ray import serve

from cluster.deploy.app import deploy
from cluster.ingress.openai_api import api

MIN_REQUESTS = 500
EXAMPLES_PER_OPERATION = 150  # per operation, both modes together; the 2 POST operations give most requests

schema = schemathesis.openapi.from_dict(api.openapi())
schema.config.generation.update(modes=["positive", "negative"], max_examples=EXAMPLES_PER_OPERATION)
sent: list[int] = []  # status codes, in order


@pytest.fixture(scope="module")
def fuzz_url(base_url, tiny_config):
    engine = tiny_config.engine.model_copy(update={"max_seq_len": 64})
    serve_cfg = tiny_config.serve.model_copy(update={"num_cpus_per_replica": 0.25})
    deploy(tiny_config.model_copy(update={"engine": engine, "serve": serve_cfg}), name="fuzz", route_prefix="/fuzz")
    with httpx.Client(base_url=f"{base_url}/fuzz", timeout=120) as client:
        yield client
    serve.delete("fuzz")


FIELD = re.compile(r"^(body|Authorization|[A-Za-z_][\w.\[\]]*): ")


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_fuzzed_requests_never_5xx_and_4xx_name_a_field(case, fuzz_url):
    request = case.as_transport_kwargs(base_url=str(fuzz_url.base_url).rstrip("/"))
    response = fuzz_url.request(request["method"], request["url"], headers=request.get("headers"),
                                params=request.get("params"), content=_content(request))
    sent.append(response.status_code)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if 400 <= response.status_code < 500:
        error = response.json()["error"]
        assert FIELD.match(error["message"]) or response.status_code in (404, 405), error


def _content(request: dict) -> bytes | None:
    import json

    if "json" in request:
        return json.dumps(request["json"]).encode()
    return request.get("data") or request.get("content")


def test_after_fuzzing_the_server_is_healthy_and_every_kv_block_free(fuzz_url):
    assert len(sent) >= MIN_REQUESTS, f"only {len(sent)} fuzzed requests"
    print(f"{len(sent)} fuzzed requests: " + ", ".join(f"{c}: {sent.count(c)}" for c in sorted(set(sent))))
    deadline = time.monotonic() + 60
    while True:
        health = fuzz_url.get("/health")
        kv = health.json().get("kv_cache", {})
        if health.status_code == 200 and health.json()["load"] == 0 and kv["free_blocks"] == kv["blocks"]:
            break
        assert time.monotonic() < deadline, health.text
        time.sleep(0.5)
    assert fuzz_url.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 4}).status_code == 200
