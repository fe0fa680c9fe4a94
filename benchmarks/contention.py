"""Served throughput when something else uses the CPU: a low-priority busy loop, a heavy client.

Every real deployment shares its cores (Ray's daemons, sidecars, log shippers, a load generator,
another replica). This script starts ``rdserve up --config CONFIG`` once and measures, over HTTP,
streaming, greedy, on the same chat prompts:

- **batch 1, quiet**: requests one after another, nothing else running (tokens/s of output);
- **batch 1, busy loop**: the same while one ``nice -n 19`` busy loop runs (the lowest priority
  there is). Target: >= 0.5x quiet;
- **light client, c**: closed loop at concurrency ``c`` with rdserve's asyncio load generator
  (``cluster.evaluation.loadgen``, a small share of one core);
- **AIPerf, c**: the same prompts at the same concurrency sent by NVIDIA AIPerf (``--aiperf``,
  installed on its own: ``python -m venv aiperf-venv && aiperf-venv/bin/pip install aiperf==0.13.0``),
  which keeps most of a core busy itself. Target: >= 0.8x the light client's tokens/s.

Output tokens/s is completion tokens (the server's ``usage``) over the wall time of the run. Prints
a Markdown table naming the CPU and the compute path (``/health``'s ``compute_path``) and writes JSON.
``--env KEY=VALUE`` (repeatable) sets variables for the server only, to compare settings (e.g.
``GOMP_SPINCOUNT``, ``RAY_worker_niceness``).

Usage:
    python benchmarks/contention.py --config configs/local.yaml --aiperf ../aiperf-venv/bin/aiperf \\
        --out benchmarks/results/contention
    python benchmarks/contention.py --smoke        # a bounded run (CI): 2 requests per case, c=2, no AIPerf
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from bench_prompts import DATASETS, chat_prompts
from bench_report import write_report
from served_vs_engine import served_run, start_server, stop_server

from cluster.config import load_config
from cluster.evaluation.prompts import PromptRow
from workers.kernels.build import cpu_model


def serving_processes(root_pid: int) -> list[dict]:
    """Ray Serve's replica and proxy processes under ``root_pid`` (``rdserve up``; other Ray clusters on
    the machine are not looked at): name, niceness and the OpenMP spin count their environment sets
    (None: libgomp's default). Linux ``/proc``."""
    import psutil

    out = []
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            title = " ".join(proc.cmdline()).strip()
            if not title.startswith(("ray::ServeReplica", "ray::ProxyActor", "ray::EngineReplica")):
                continue
            out.append({"pid": proc.pid, "title": title.split()[0], "nice": proc.nice(),
                        "GOMP_SPINCOUNT": proc.environ().get("GOMP_SPINCOUNT")})
        except (psutil.Error, OSError):
            continue
    return sorted(out, key=lambda p: p["title"])


@contextmanager
def busy_loop(niceness: int = 19):
    """One CPU-bound process at ``niceness`` for the duration of the block."""
    proc = subprocess.Popen(["nice", "-n", str(niceness), sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def aiperf_run(aiperf: str, base_url: str, model: str, tokenizer: str, rows: list[PromptRow], concurrency: int,
               num_requests: int, max_tokens: int, duration_s: float) -> dict:
    """NVIDIA AIPerf (``aiperf profile``) at ``concurrency``, streaming chat, the prompts of ``rows``
    (a ``single_turn`` dataset of their last user message), ``max_tokens`` and temperature 0; output
    tokens/s from the server's usage over AIPerf's benchmark duration (at most ``duration_s`` of sending:
    a collapsed server still ends the run).

    Raises:
        RuntimeError: AIPerf failed or wrote no metrics (the end of its output is in the message).
    """
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "prompts.jsonl"
        data.write_text("".join(json.dumps({"text": r.messages[-1]["content"]}) + "\n" for r in rows))
        cmd = [aiperf, "profile", "--model", model, "--url", base_url, "--endpoint-type", "chat", "--streaming",
               "--tokenizer", tokenizer, "--input-file", str(data), "--custom-dataset-type", "single_turn",
               "--concurrency", str(concurrency), "--request-count", str(num_requests),
               "--benchmark-duration", str(duration_s), "--benchmark-grace-period", "60",
               "--extra-inputs", json.dumps({"max_tokens": max_tokens, "temperature": 0.0}),
               "--use-legacy-max-tokens", "--use-server-token-count", "--ui-type", "none",
               "--output-artifact-dir", tmp, "--no-auto-plot"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        found = sorted(Path(tmp).rglob("profile_export_aiperf.json"))
        if proc.returncode or not found:
            raise RuntimeError(f"aiperf exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
        metrics = json.loads(found[0].read_text())
    out = {k: metrics[k] for k in ("output_token_throughput", "time_to_first_token", "inter_token_latency",
                                   "request_count", "error_request_count") if k in metrics}
    tps = out.get("output_token_throughput", {})
    return {"output_throughput": tps.get("avg") if isinstance(tps, dict) else tps, "aiperf": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml", help="rdserve config served by `rdserve up`")
    ap.add_argument("--prompts", default=str(DATASETS / "broad/dev.jsonl"), help="prompt JSONL (chat rows)")
    ap.add_argument("--num-requests", type=int, default=8, help="requests per batch-1 case")
    ap.add_argument("--max-tokens", type=int, default=128, help="completion tokens per request (at most)")
    ap.add_argument("--concurrency", default="4,16", help="comma-separated concurrency levels (client cases)")
    ap.add_argument("--client-requests", type=int, default=4, help="requests per client case = this x concurrency")
    ap.add_argument("--aiperf", default=shutil.which("aiperf"), help="AIPerf executable (its own venv); none: skipped")
    ap.add_argument("--aiperf-duration", type=float, default=120.0, help="AIPerf sends for at most this many seconds")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server's environment (repeatable)")
    ap.add_argument("--smoke", action="store_true", help="bounded run: 2 requests per case, c=2, 16 tokens, no AIPerf")
    ap.add_argument("--out", default="benchmarks/results/contention", help="output prefix (.md and .json)")
    args = ap.parse_args()
    if args.smoke:
        args.num_requests, args.max_tokens, args.concurrency, args.client_requests, args.aiperf = 2, 16, "2", 1, None
    cfg = load_config(args.config)
    base_url = f"http://{cfg.serve.host}:{cfg.serve.port}"
    model = cfg.model.name
    rows = chat_prompts(args.prompts) if Path(args.prompts).exists() else [
        PromptRow(category="smoke", messages=[{"role": "user", "content": "Name three rivers in Europe."}])]
    levels = [int(c) for c in args.concurrency.split(",") if c]
    env = dict(kv.split("=", 1) for kv in args.env)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        proc = start_server(args.config, base_url)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    results: dict = {"cpu": cpu_model(), "config": args.config, "env": env, "max_tokens": args.max_tokens, "cases": {}}
    try:
        health = httpx.get(f"{base_url}/health", timeout=10).json()
        results["compute_path"] = health.get("compute_path")
        results["serving_processes"] = serving_processes(proc.pid)
        batch1 = rows[: args.num_requests]
        served_run(base_url, model, rows[:2], 2, 1, "plain", 16)  # warm-up
        run = lambda c, n, label: results["cases"].__setitem__(label, {  # noqa: E731
            "concurrency": c, **served_run(base_url, model, (rows * (1 + n // len(rows)))[:n], n, c, "auto", args.max_tokens)})
        run(1, len(batch1), "batch 1, quiet")
        with busy_loop():
            run(1, len(batch1), "batch 1, nice-19 busy loop")
        for c in levels:
            run(c, args.client_requests * c, f"light client, c={c}")
            if args.aiperf:
                from workers.models.pull import pull_default

                tokenizer = str(cfg.model.path or pull_default())
                n = args.client_requests * c
                results["cases"][f"AIPerf, c={c}"] = {"concurrency": c, **aiperf_run(
                    args.aiperf, base_url, model, tokenizer, (rows * (1 + n // len(rows)))[:n], c, n, args.max_tokens,
                    args.aiperf_duration)}
        # what the adaptive thread policy measured and chose, per size class of step (absent when off)
        results["threads"] = httpx.get(f"{base_url}/health", timeout=10).json().get("threads")
    finally:
        stop_server(proc)
    cases = results["cases"]
    quiet = cases["batch 1, quiet"]["output_throughput"]
    ratios = {"busy loop / quiet (batch 1; target >= 0.5)": cases["batch 1, nice-19 busy loop"]["output_throughput"] / quiet}
    for c in levels:
        if f"AIPerf, c={c}" in cases and cases[f"AIPerf, c={c}"]["output_throughput"]:
            ratios[f"AIPerf / light client, c={c} (target >= 0.8)"] = (
                cases[f"AIPerf, c={c}"]["output_throughput"] / cases[f"light client, c={c}"]["output_throughput"])
    results["ratios"] = ratios
    procs = ", ".join(sorted({f"{p['title']} nice {p['nice']}" for p in results["serving_processes"]}))
    lines = [f"CPU: {results['cpu']}; compute path: {results['compute_path']}; config {args.config}; "
             f"server env {env or 'default'}; {args.max_tokens} tokens per request, greedy, streaming", "",
             f"Serving processes: {procs}", "",
             "| case | concurrency | output tokens/s |", "|---|---|---|"]
    lines += [f"| {label} | {c['concurrency']} | {c['output_throughput']:.1f} |" for label, c in cases.items()]
    lines += ["", "| ratio | value |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in ratios.items()]
    print("\n".join(lines))
    write_report(args.out, "\n".join(lines), results)


if __name__ == "__main__":
    main()
