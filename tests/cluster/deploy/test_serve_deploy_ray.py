"""What goes into a RayService is what runs: `rdserve serve-config` deployed with Ray's own `serve deploy`
(REST through the dashboard) on a Ray cluster of its own, answering over HTTP from a tiny model; and
GPU bundles of a TP placement group resolved to one GPU per rank by Ray (logical GPUs: no GPU needed).

The cluster is a separate `ray start --head` (tests/ray_cluster.py) on its own ports and temp dir, so it
does not touch the session's Ray instance; ~100 s on 2 busy cores.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from ray_cluster import free_ports, start_head

from cluster.deploy.app import SERVE_ENV

PROJECT_ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def head():
    head = start_head(num_cpus=4, num_gpus=2, env=SERVE_ENV)
    try:
        yield head
    finally:
        head.stop()


def _run(cmd: list[str], env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=PROJECT_ROOT, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd[:3]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_serve_deploy_of_serve_config_answers_over_http(head, tiny_config_path, tmp_path):
    (port,) = free_ports(1)
    config = tiny_config_path.parent / "deploy.yaml"  # beside the tiny model: its relative paths resolve
    config.write_text(tiny_config_path.read_text() + f"serve: {{port: {port}, num_cpus_per_replica: 0.5, "
                      "autoscaling: {min_replicas: 1, max_replicas: 2, target_ongoing_requests: 4}}\n")
    serve_yaml = tmp_path / "serve.yaml"
    _run([str(BIN / "rdserve"), "serve-config", "--config", str(config), "--out", str(serve_yaml)], {})
    _run([str(BIN / "serve"), "deploy", str(serve_yaml), "--address", head.dashboard], head.env)

    base = f"http://127.0.0.1:{port}"
    deadline, health = time.monotonic() + 300, None
    while time.monotonic() < deadline:
        try:
            health = httpx.get(f"{base}/health", timeout=5)
            if health.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(2)
    assert health is not None and health.status_code == 200, "the deployed application never became healthy"
    assert health.json()["model"] == "tiny-llama"
    reply = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["completion_tokens"] == 6 and body["choices"][0]["message"]["role"] == "assistant"

    details = httpx.get(f"{head.dashboard}/api/serve/applications/", timeout=30,
                        headers={"Authorization": f"Bearer {head.env['RAY_AUTH_TOKEN']}"}).json()
    application = details["applications"]["rdserve"]
    assert application["status"] == "RUNNING"
    deployed = application["deployments"]["EngineReplica"]["deployment_config"]
    written = next(d for d in yaml.safe_load(serve_yaml.read_text())["applications"][0]["deployments"]
                   if d["name"] == "EngineReplica")
    assert deployed["autoscaling_config"]["policy"] == written["autoscaling_config"]["policy"]
    assert deployed["max_ongoing_requests"] == written["max_ongoing_requests"]
    assert deployed["ray_actor_options"]["num_cpus"] == 0.5
    assert deployed["ray_actor_options"]["runtime_env"]["env_vars"] == SERVE_ENV


PLACEMENT_DRIVER = """
import json, os, sys
import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from cluster.replica.placement import TP_PLACEMENT_STRATEGY, placement_gpu_ids, tp_bundles

ray.init(address=sys.argv[1], logging_level="ERROR")

@ray.remote(num_cpus=0.5, num_gpus=1)
class Leader:
    def gpus(self):
        try:
            return {"ranks": placement_gpu_ids(2), "own": os.environ["CUDA_VISIBLE_DEVICES"]}
        except RuntimeError as err:
            return {"error": str(err)}

pg = placement_group(tp_bundles(2, 0.5), strategy=TP_PLACEMENT_STRATEGY)
ray.get(pg.ready(), timeout=60)
inside = Leader.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
    pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)).remote()
placed = ray.get(inside.gpus.remote(), timeout=120)
ray.kill(inside)
ray.util.remove_placement_group(pg)
outside = ray.get(Leader.remote().gpus.remote(), timeout=120)
print(json.dumps({"placed": placed, "outside": outside}))
"""


def test_placement_bundles_give_each_rank_its_own_gpu(head):
    proc = _run([sys.executable, "-c", PLACEMENT_DRIVER, head.address], head.env)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    ranks = result["placed"]["ranks"]
    assert sorted(ranks) == ["0", "1"]  # the cluster's two (logical) GPUs, one per bundle
    assert ranks[0] == result["placed"]["own"]  # rank 0 is the replica actor itself
    assert "needs a placement group" in result["outside"]["error"]
