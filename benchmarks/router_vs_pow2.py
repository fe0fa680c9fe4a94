"""Two engine replicas behind the goodput request router vs Ray Serve's default power-of-two router.

One Ray Serve instance with two applications of the same config, each with ``--replicas`` engine
replicas (``engine.num_threads`` cores / replicas each): ``serve.request_router: goodput`` and
``pow2``. Closed-loop concurrency levels over HTTP, the two routers interleaved level by level (each
app's replicas idle while the other is measured; ``--rounds`` passes, pooled). Prints output tokens/s and TPOT p50/p90 per level
and writes JSON.

Usage:
    python benchmarks/router_vs_pow2.py --config configs/local.yaml --concurrency 2,4,8 \
        --out benchmarks/results/router_vs_pow2
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bench_prompts import DATASETS
from bench_report import write_report
from bench_serve import config_with_model, local_serve
from spec_policies import prompt_mix

from cluster.evaluation.loadgen import LoadSpec, RunResult, run_load

ROUTERS = ("goodput", "pow2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml", help="base config")
    ap.add_argument("--replicas", type=int, default=2, help="engine replicas per application")
    ap.add_argument("--concurrency", default="2,4,8", help="closed-loop concurrency levels")
    ap.add_argument("--requests-per-client", type=int, default=4, help="requests per level = this x concurrency")
    ap.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request (at most)")
    ap.add_argument("--datasets-dir", default=str(DATASETS), help="holds broad/, gsm8k/ and humaneval/")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the levels (the router measured first "
                    "alternates); each cell pools every pass")
    ap.add_argument("--out", default="benchmarks/results/router_vs_pow2", help="output path without suffix")
    args = ap.parse_args()

    from cluster.deploy.app import deploy

    cfg = config_with_model(args.config)
    threads = max(1, (os.cpu_count() or 1) // args.replicas)
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"num_threads": threads})})
    rows = prompt_mix("broad", Path(args.datasets_dir))
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict = {r: {} for r in ROUTERS}
    with local_serve() as port:
        for router in ROUTERS:
            serve_cfg = cfg.serve.model_copy(update={"replicas": args.replicas, "request_router": router,
                                                     "num_cpus_per_replica": 1.0})
            deploy(cfg.model_copy(update={"serve": serve_cfg}), name=router, route_prefix=f"/{router}")
        runs: dict = {r: {c: [] for c in levels} for r in ROUTERS}
        for rnd in range(args.rounds):
            for c in levels:
                for router in ROUTERS if rnd % 2 == 0 else ROUTERS[::-1]:  # alternate which goes first
                    url = f"http://127.0.0.1:{port}/{router}"
                    spec = LoadSpec(model=cfg.model.name, max_tokens=args.max_tokens, concurrency=c,
                                    max_requests=args.requests_per_client * c, duration_s=3600, grace_s=120)
                    run = run_load(url, rows, spec, progress=False)
                    runs[router][c].append(run)
                    s = run.summary()
                    print(f"round {rnd + 1}/{args.rounds} c={c} {router}: {s['output_throughput']:.1f} tok/s, "
                          f"TPOT p50 {s['tpot_ms']['p50']:.0f} ms", flush=True)
        for router in ROUTERS:
            for c in levels:  # every pass pooled: tokens over time, latency percentiles over all requests
                cell = runs[router][c]
                pooled = RunResult(cell[0].spec, [rec for run in cell for rec in run.records],
                                   sum(run.duration_s for run in cell))
                s = pooled.summary()
                served_by = {}
                for rec in pooled.records:
                    replica = (rec.rdserve or {}).get("replica")
                    served_by[replica] = served_by.get(replica, 0) + 1
                results[router][c] = {"output_throughput": s["output_throughput"], "failed": s["failed"],
                                      "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p90_ms": s["tpot_ms"]["p90"],
                                      "ttft_p50_ms": s["ttft_ms"]["p50"], "requests_per_replica": sorted(served_by.values()),
                                      "passes_output_throughput": [run.summary()["output_throughput"] for run in cell]}
    lines = [f"{args.replicas} replicas x {threads} thread(s), max_tokens {args.max_tokens}, "
             f"{args.requests_per_client} requests per client, {args.rounds} pass(es) pooled", "",
             "| concurrency | goodput tok/s | pow2 tok/s | goodput TPOT p50/p90 ms | pow2 TPOT p50/p90 ms | "
             "requests per replica (goodput / pow2) |", "|---|---|---|---|---|---|"]
    for c in levels:
        g, p = results["goodput"][c], results["pow2"][c]
        lines.append(f"| {c} | {g['output_throughput']:.1f} | {p['output_throughput']:.1f} | "
                     f"{g['tpot_p50_ms']:.0f}/{g['tpot_p90_ms']:.0f} | {p['tpot_p50_ms']:.0f}/{p['tpot_p90_ms']:.0f} | "
                     f"{g['requests_per_replica']} / {p['requests_per_replica']} |")
    table = "\n".join(lines)
    print(table)
    write_report(args.out, table, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
