"""A tensor-parallel engine replica (TP2 over MPI, tiny model): serves, and when a rank dies the
request in flight ends with a 500 and Serve's health probe fails, so Serve replaces the replica.

The scenario runs in its own process: MPICH cannot start another group in a process that lost a
rank (``workers/tp/README.md``).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from cluster.ingress.messages import EngineRequest
from cluster.replica.replica import EngineReplica
from workers.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[3]

SCENARIO = """
import asyncio, json, os, sys
from cluster.config import load_config
from cluster.ingress.messages import EngineRequest, Failed
from cluster.replica.replica import EngineReplica
from workers.sampling_params import SamplingParams

replica = EngineReplica.func_or_class(load_config(sys.argv[1]))

def request(mode):
    return EngineRequest(prompt="Once upon a time", messages=None, sampling=SamplingParams(temperature=0.0),
                         max_tokens=24, max_tokens_field="max_tokens", mode=mode)

async def collect(stream):
    return [item async for item in stream]

out = {}
for mode in ("plain", "spec"):
    items = asyncio.run(collect(replica.generate(request(mode))))
    out[mode] = sum((d.token_ids for d in items[1:]), [])
replica.check_health()
os.kill(replica.engine.executor.comm.pids[1], 9)
items = asyncio.run(collect(replica.generate(request("plain"))))
out["after_kill"] = [items[-1].status, items[-1].message] if isinstance(items[-1], Failed) else repr(items[-1])
try:
    replica.check_health()
    out["health"] = "ok"
except RuntimeError as err:
    out["health"] = str(err)
print(json.dumps(out))
os._exit(0)
"""


def test_tp2_replica_serves_and_reports_a_dead_rank(tiny_config_path, tiny_config):
    config = tiny_config_path.parent / "tp2.yaml"
    config.write_text(tiny_config_path.read_text().replace("num_threads: 1", "num_threads: 1, tp_size: 2"))
    proc = subprocess.run([sys.executable, "-c", SCENARIO, str(config)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])

    reference = EngineReplica.func_or_class(tiny_config)

    async def tokens(mode):
        req = EngineRequest(prompt="Once upon a time", messages=None, sampling=SamplingParams(temperature=0.0),
                            max_tokens=24, max_tokens_field="max_tokens", mode=mode)
        items = [item async for item in reference.generate(req)]
        return sum((d.token_ids for d in items[1:]), [])

    for mode in ("plain", "spec"):
        assert result[mode] == asyncio.run(tokens(mode)), mode
    status, message = result["after_kill"]
    assert status == 500 and "TP rank 1" in message
    assert "TP rank 1" in result["health"]
