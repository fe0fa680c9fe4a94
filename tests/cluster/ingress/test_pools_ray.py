"""Two-pool mode on the session's local Ray cluster: a speculative and a plain pool of the tiny model.

At low load requests go to the speculative pool; a burst moves some to the plain pool; none is lost
and every greedy output equals the prompt's solo output (both pools decode losslessly).
"""

import asyncio
import json

import httpx
import pytest
from ray import serve

from cluster.deploy.app import deploy
from cluster.config import PoolConfig, PoolsConfig
from workers.speculation.goodput import StepCosts
from cluster.ingress.pools import choose_pool

MODEL_NAME = "tiny-llama"
# Step costs that make one tree cheap next to one request and costly in a batch (the tiny model's own
# costs do not matter: the ingress decides from this file). The ingress also weighs the spec pool's
# live tokens per step (tau), which the tiny model's drafter sets by its luck on the prompts (a CI run
# saw 1.00); the costs are chosen so that the decisions under test hold for every tau a 2x3 tree can
# give (1 <= tau <= 4): alone, a request speculates (tau / 0.025 >= 40 tok/s against 1 / 0.030 = 33
# plain); a burst spills (at 7 in flight on the spec pool even tau 4 gives 4 / 0.14 = 29 < 33).
CALIBRATION = {"plain_step_s": {"1": 0.030, "4": 0.040, "8": 0.060},
               "spec_step_s": {"1:2x3": 0.025, "4:2x3": 0.080, "8:2x3": 0.160},
               "tokens_per_step": {"2x3": 2.0}}


@pytest.fixture(scope="module")
def pools_url(base_url, tiny_config, tmp_path_factory):
    path = tmp_path_factory.mktemp("pools") / "calibration.json"
    path.write_text(json.dumps(CALIBRATION))
    engine = tiny_config.engine.model_copy(update={"num_threads": 1})
    spec = tiny_config.speculation.model_copy(update={"calibration": path})
    pools = PoolsConfig(spec=PoolConfig(replicas=1), plain=PoolConfig(replicas=1))
    serve_cfg = tiny_config.serve.model_copy(update={"pools": pools, "num_cpus_per_replica": 0.5})
    deploy(tiny_config.model_copy(update={"engine": engine, "speculation": spec, "serve": serve_cfg}), name="pools",
           route_prefix="/pools")
    yield f"{base_url}/pools"
    serve.delete("pools")


async def complete(client: httpx.AsyncClient, i: int, stream: bool = False) -> dict:
    body = {"model": MODEL_NAME, "prompt": f"Tale {i}: once upon a time", "max_tokens": 24, "temperature": 0,
            "stream": stream}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        return {"text": data["choices"][0]["text"], "reason": data["rdserve"]["reason"]}
    text, reason = [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += [c["text"] for c in chunk["choices"]]
                reason = (chunk.get("rdserve") or {}).get("reason") or reason
    return {"text": "".join(text), "reason": reason}


@pytest.mark.parametrize("tau", [1.0, 1.5, 2.0, 3.0, 4.0])
def test_the_calibration_decides_whatever_the_live_tau(tau):
    """What the Ray test below relies on: alone a request speculates, and the spec pool spills before
    7 requests are in flight on it, at every tau a 2x3 tree can measure."""
    costs = StepCosts.from_calibration(CALIBRATION)
    assert choose_pool(costs, (2, 3), tau, 0, 1, 0, 1)[0] == "spec"
    assert choose_pool(costs, (2, 3), tau, 6, 1, 0, 1)[0] == "plain"


def test_low_load_speculates_and_a_burst_spills_to_the_plain_pool(pools_url):
    async def scenario():
        async with httpx.AsyncClient(base_url=pools_url, timeout=120) as client:
            solo = [await complete(client, i) for i in range(8)]
            burst = await asyncio.gather(*(complete(client, i, stream=i % 2 == 0) for i in range(8) for _ in range(2)))
            health = (await client.get("/health")).json()
            return solo, burst, health

    solo, burst, health = asyncio.run(scenario())
    assert all(r["reason"].startswith("pool spec:") for r in solo), [r["reason"] for r in solo]
    pools = [r["reason"].split(":")[0] for r in burst]
    assert pools.count("pool spec") >= 1 and pools.count("pool plain") >= 1, pools
    assert [r["text"] for r in burst] == [solo[i]["text"] for i in range(8) for _ in range(2)]
    assert health["replicas"].keys() == {"spec", "plain"}
    assert health["pools"]["in_flight"] == {"spec": 0, "plain": 0}  # every request was counted out


def test_a_forced_mode_picks_its_pool(pools_url):
    for mode in ("plain", "spec"):
        r = httpx.post(f"{pools_url}/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "rdserve": {"mode": mode}})
        assert r.status_code == 200 and r.json()["rdserve"]["reason"].startswith(f"pool {mode}: requested")
