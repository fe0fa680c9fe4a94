"""The contention benchmark's bounded version (``benchmarks/contention.py --smoke``) against a real
``rdserve up`` of the tiny model on two threads: every case is served (quiet, under a ``nice -n 19``
busy loop, a concurrent client), and the serving processes run as ordinary processes: niceness 0
(Ray's default 15 let a nice-19 loop or any client take their cores) with the OpenMP spin count
rdserve sets (libgomp's default spins for milliseconds on a core another thread needs). Speed is
the benchmark's business (BENCHMARKS.md), not this test's."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from cluster.deploy.app import SERVE_ENV

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME, MAX_SEQ_LEN = "tiny-llama", 256  # the tiny model of tests/cluster/conftest.py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_contention_smoke_serves_every_case_from_fairly_scheduled_processes(tiny_config_path, tmp_path):
    config = tiny_config_path.parent / "contention.yaml"
    config.write_text(f"model: {{name: {MODEL_NAME}, path: model}}\ndrafter: {{path: drafter}}\n"
                      f"engine: {{max_seq_len: {MAX_SEQ_LEN}, num_threads: 2}}\n"
                      "speculation: {num_beams: 2, draft_len_per_beam: 3}\n"
                      f"serve: {{port: {_free_port()}}}\nobservability: {{metrics_port: {_free_port()}}}\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n"
                               for q in ("Once upon a time", "Tell me about rivers")))
    out = tmp_path / "contention"
    proc = subprocess.run([sys.executable, "benchmarks/contention.py", "--config", str(config), "--smoke",
                           "--prompts", str(prompts), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    cases = report["cases"]
    assert set(cases) == {"batch 1, quiet", "batch 1, nice-19 busy loop", "light client, c=2"}
    assert all(c["output_tokens"] > 0 and c["output_throughput"] > 0 for c in cases.values()), cases
    processes = report["serving_processes"]
    assert any("OpenAIIngress" in p["title"] or "EngineReplica" in p["title"] for p in processes), processes  # ours only
    assert all(p["nice"] == 0 and p["GOMP_SPINCOUNT"] == SERVE_ENV["GOMP_SPINCOUNT"] for p in processes), processes
    assert "busy loop / quiet (batch 1; target >= 0.5)" in report["ratios"]
    assert report["compute_path"] and report["cpu"]
    if not report["compute_path"].endswith("-torch"):  # rdserve's kernels: adaptive threads on, shown in /health
        batch1 = report["threads"]["rows<2"]  # batch-1 decode steps: both counts measured, each step counted
        assert set(batch1) == {"1", "2"} and all(v["ms"] > 0 and v["steps"] >= 1 for v in batch1.values()), batch1
