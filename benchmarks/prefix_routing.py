"""Routing that follows the prefix cache: two replicas (``--replicas``), the same multi-turn traffic, three routers.

The conversations of ``benchmarks/prefix_cache.py`` (``--prompts`` user turns behind its ~500-token
system prompt; a conversation's turn k carries the whole conversation so far), served by CONFIG with
``serve.replicas: 2``, prefix caching on, and each of:

- ``pow2``: Ray Serve's default router (``serve.request_router: pow2``);
- ``goodput``: rdserve's goodput router without the cache (``serve.prefix_aware_routing: false``);
- ``goodput+prefix``: the goodput router that counts each replica's uncached prefill (the default).

Each (router, concurrency) runs on a freshly started ``rdserve up``, so no level finds another's cached
blocks; the routers' order rotates from level to level, so machine drift hits all three. Per row: TTFT
p50/p90 (all turns and turns >= 2, where a conversation's history can be cached), output tokens/s, the
cache hit rate (``usage.prompt_tokens_details.cached_tokens`` / ``prompt_tokens``), and the share of
turns >= 2 served by the replica that served the conversation's previous turn. ``--think-s`` adds a user's
pause between turns: without it a conversation's next turn arrives the moment its answer ends, when the
replica that served it has just freed a slot, so a shortest-queue router (pow2) sends it back there. Per concurrency: TTFT
p50 and tokens/s of each goodput router against pow2's (targets: goodput+prefix TTFT p50 <= 0.6x,
tokens/s >= 1.0x). A third table sets each router's prefill per turn >= 2 against the fewest tokens
any router prefilled for the same turn: what a router that always found the conversation's replica
could still save. Prints Markdown tables naming the CPU and compute path; writes JSON with the command.

On a machine with few cores set ``engine.num_threads`` so the two replicas do not oversubscribe them
(``--threads``; default: cores / 2).

With two replicas, pow2 samples both every time: it is join-the-shortest-queue, and in a closed loop
the conversation's replica has just freed a slot. ``--replicas 4`` shows the routers where pow2 sees
the conversation's replica among its two samples only half the time (on few cores the replicas then
share them: compare the routers with each other, not with a two-replica run).

Usage:
    python benchmarks/prefix_routing.py --config configs/local.yaml --num-conversations 24 \\
        --concurrency 4,16 --out benchmarks/results/prefix_routing
    python benchmarks/prefix_routing.py --config configs/local.yaml --num-conversations 24 \
        --concurrency 16 --think-s 3 --out benchmarks/results/prefix_routing_think   # users pause between turns
    python benchmarks/prefix_routing.py --config configs/local.yaml --num-conversations 24 \\
        --concurrency 16 --num-kv-blocks 1024 --out benchmarks/results/prefix_routing_pressure  # caches under pressure
    python benchmarks/prefix_routing.py --config configs/local.yaml --num-conversations 24 --concurrency 16 \\
        --think-s 3 --system-prompt default --out benchmarks/results/prefix_routing_own  # little shared prefix
    python benchmarks/prefix_routing.py --num-conversations 2 --min-turns 3 --max-turns 3 \\
        --concurrency 2 --max-tokens 8 --out /tmp/prefix_routing_smoke          # a quick check
    python benchmarks/prefix_routing.py --from-json benchmarks/results/zen4/prefix_routing.json  # a saved run's tables
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path

import httpx
import yaml
from bench_ports import free_port
from bench_report import write_report
from bench_serve import absolute_paths
from prefix_cache import add_workload_options, fmt, load_workload, percentile_ms, run_level, summarize, warm_up
from served_vs_engine import start_server, stop_server

from cluster.config import load_config

ROUTERS = {
    "pow2": {"request_router": "pow2"},
    "goodput": {"request_router": "goodput", "prefix_aware_routing": False},
    "goodput+prefix": {"request_router": "goodput", "prefix_aware_routing": True},
}


def router_config(config: Path, router: str, threads: int, out_dir: Path,
                  num_kv_blocks: int | None = None, replicas: int = 2) -> tuple[Path, int]:
    """CONFIG with ``replicas`` replicas, prefix caching on, ``router``'s serve fields, ``threads`` engine threads
    per replica, ``num_kv_blocks`` KV blocks per replica (None: CONFIG's) and free ports; returns the
    copy's path and HTTP port."""
    data = absolute_paths(yaml.safe_load(config.read_text()) or {}, config.resolve().parent)
    data["engine"] = {**(data.get("engine") or {}), "enable_prefix_caching": True, "num_threads": threads}
    if num_kv_blocks is not None:
        data["engine"]["num_kv_blocks"] = num_kv_blocks
    port = free_port()
    data["serve"] = {**(data.get("serve") or {}), **ROUTERS[router], "replicas": replicas, "autoscaling": None,
                     "port": port}
    # Ray places a replica only where its logical CPUs are free: more replicas than cores share them
    cores = os.cpu_count() or 2
    per_replica = float(data["serve"].get("num_cpus_per_replica") or 1.0)
    data["serve"]["num_cpus_per_replica"] = min(per_replica, cores / replicas)
    data["observability"] = {**(data.get("observability") or {}), "metrics_port": free_port()}
    path = out_dir / f"router_{router.replace('+', '_')}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_config(path)  # fail here, naming the field, rather than in the server
    return path, port


def affinity(records: list[dict]) -> float | None:
    """Share of turns >= 2 served by the replica of the conversation's previous turn."""
    by_conv: dict = {}
    for r in sorted(records, key=lambda r: (r["conversation"], r["turn"])):
        by_conv.setdefault(r["conversation"], []).append((r.get("rdserve") or {}).get("replica"))
    pairs = [(a, b) for reps in by_conv.values() for a, b in zip(reps, reps[1:])]
    return sum(a == b and a is not None for a, b in pairs) / len(pairs) if pairs else None


def uncached_turn2plus(records: list[dict]) -> dict[tuple[int, int], int]:
    """Prompt tokens prefilled (``prompt_tokens - cached_tokens`` from ``usage``) per (conversation, turn)
    for turns >= 2, the turns whose history a replica can hold."""
    out = {}
    for r in records:
        usage = r.get("usage") or {}
        if r["turn"] >= 2 and "prompt_tokens" in usage:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            out[(r["conversation"], r["turn"])] = usage["prompt_tokens"] - cached
    return out


def prefill_headroom(results: dict, levels: list[int]) -> dict:
    """What any router could still save on this traffic: per (router, concurrency), the prompt tokens
    prefilled per turn >= 2, against the fewest any of the routers prefilled for the same
    (conversation, turn) at that concurrency (a replica that held the whole conversation: its new
    user turn and what its last block left). ``headroom`` is the share of a router's prefill that a
    router matching that best case on every turn would save."""
    out = {}
    for c in levels:
        per_router = {router: uncached_turn2plus(results["levels"][f"{router} c={c}"]["records"]) for router in ROUTERS}
        keys = set.intersection(*(set(u) for u in per_router.values()))
        if not keys:
            continue
        best = {k: min(u[k] for u in per_router.values()) for k in keys}
        best_mean = sum(best.values()) / len(keys)
        for router, u in per_router.items():
            mean = sum(u[k] for k in keys) / len(keys)
            out[f"{router} c={c}"] = {"turns": len(keys), "uncached_per_turn": mean, "fewest_per_turn": best_mean,
                                      "headroom": 1 - best_mean / mean if mean else 0.0}
    return out


def serve_level(config: Path, router: str, convs: list[dict], concurrency: int, model: str, tmp: Path,
                args) -> dict:
    path, port = router_config(config, router, args.threads, tmp, args.num_kv_blocks, args.replicas)
    base_url = f"http://127.0.0.1:{port}"
    proc = start_server(str(path), base_url)
    try:
        warm_up(base_url, model, args)
        records, wall = asyncio.run(run_level(base_url, model, convs, concurrency, args))
        health = httpx.get(f"{base_url}/health", timeout=30.0).json()
    finally:
        stop_server(proc)
    summary = summarize(records, wall)
    later = [r["ttft_s"] for r in records if r["turn"] >= 2 and r["ttft_s"] is not None]
    summary["ttft_p50_ms_turn2plus"] = percentile_ms(later, 50)
    summary["ttft_p90_ms_turn2plus"] = percentile_ms(later, 90)
    summary["affinity"] = affinity(records)
    summary["replicas_used"] = sorted({(r.get("rdserve") or {}).get("replica") or "?" for r in records})
    summary["compute_path"] = health.get("compute_path")
    summary["records"] = [{k: v for k, v in r.items() if k != "text"} for r in records]
    return summary


def report(args, results: dict, levels: list[int]) -> str:
    convs = results["conversations"]
    turns = [len(c["lines"]) for c in convs]
    lines = [f"CPU: {results['cpu']}; compute path: {results['compute_path']}; config {args.config}, {args.replicas} replicas x "
             f"{args.threads} thread(s), prefix caching on, KV blocks per replica "
             f"{args.num_kv_blocks or 'as configured'}, system prompt '{args.system_prompt}' "
             f"({results['system_prompt_tokens']} tokens); {len(convs)} conversations of {min(turns)}-{max(turns)} "
             f"turns ({sum(turns)} requests per row) from {Path(args.prompts).name}, greedy, max_tokens "
             f"{args.max_tokens}, think time {args.think_s} s mean; a fresh server per row", "",
             "| concurrency | router | TTFT p50 ms | TTFT p90 ms | p50 turn 2+ | p90 turn 2+ | output tok/s | "
             "hit rate | same replica as previous turn |", "|---|---|---|---|---|---|---|---|---|"]
    for c in levels:
        for router in ROUTERS:
            s = results["levels"][f"{router} c={c}"]
            lines.append(f"| {c} | {router} | {fmt(s['ttft_p50_ms'])} | {fmt(s['ttft_p90_ms'])} | "
                         f"{fmt(s['ttft_p50_ms_turn2plus'])} | {fmt(s['ttft_p90_ms_turn2plus'])} | "
                         f"{s['output_tokens_per_s']:.1f} | {fmt(s['hit_rate'], '.1%')} | {fmt(s['affinity'], '.0%')} |")
    lines += ["", "| concurrency | router | TTFT p50 vs pow2 | target | tok/s vs pow2 | target |", "|---|---|---|---|---|---|"]
    for c in levels:
        for router in ("goodput", "goodput+prefix"):
            cmp = results["comparison"][f"{router} c={c}"]
            target = router == "goodput+prefix"
            lines.append(f"| {c} | {router} | {fmt(cmp['ttft_p50_ratio'], '.2f')}x | {'<= 0.6x' if target else '-'} | "
                         f"{fmt(cmp['tokens_per_s_ratio'], '.2f')}x | {'>= 1.0x' if target else '-'} |")
    headroom = results.get("prefill_headroom") or {}
    if headroom:
        lines += ["", "Prefill per turn >= 2 against the fewest tokens any router prefilled for the same turn "
                  "(what a router that always found the conversation's replica could still save):", "",
                  "| concurrency | router | uncached prompt tokens per turn | fewest any router reached | "
                  "prefill a perfect router would save |", "|---|---|---|---|---|"]
        for c in levels:
            for router in ROUTERS:
                h = headroom.get(f"{router} c={c}")
                if h:
                    lines.append(f"| {c} | {router} | {h['uncached_per_turn']:.0f} | {h['fewest_per_turn']:.0f} | "
                                 f"{h['headroom']:.0%} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_options(ap, concurrency="4,16", num_conversations=24)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                    help="engine.num_threads of each replica")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="engine.num_kv_blocks of each replica (default: the config's sizing). A cache that holds "
                         "about half the conversations puts it under pressure: a router that spreads a "
                         "conversation over both replicas then evicts what one that follows the cache keeps")
    ap.add_argument("--replicas", type=int, default=2,
                    help="engine replicas (default 2, the issue's setup; with more, pow2 samples two of them)")
    ap.add_argument("--out", default="benchmarks/results/prefix_routing", help="output path without suffix")
    ap.add_argument("--from-json", default=None, metavar="PATH",
                    help="print the tables of a run saved earlier (its JSON, with the prefill headroom table), "
                         "start nothing")
    args = ap.parse_args()
    if args.from_json:
        print(rerender(Path(args.from_json)))
        return
    if args.replicas < 2:
        ap.error(f"--replicas must be >= 2 (routing chooses between replicas), got {args.replicas}")
    if args.num_kv_blocks is not None and args.num_kv_blocks < 1:
        ap.error(f"--num-kv-blocks must be >= 1, got {args.num_kv_blocks}")
    cfg, levels, convs, results = load_workload(ap, args)
    names = list(ROUTERS)
    with tempfile.TemporaryDirectory(prefix="rdserve-routing-") as tmp:
        for i, c in enumerate(levels):
            for router in names[i % 3:] + names[:i % 3]:
                print(f"{router}, concurrency {c}: {len(convs)} conversations...", flush=True)
                s = serve_level(Path(args.config), router, convs, c, cfg.model.name, Path(tmp), args)
                results["levels"][f"{router} c={c}"] = s
                print(f"{router} c={c}: TTFT p50 {fmt(s['ttft_p50_ms'])} ms (turn 2+ {fmt(s['ttft_p50_ms_turn2plus'])}), "
                      f"{s['output_tokens_per_s']:.1f} tok/s, hit rate {fmt(s['hit_rate'], '.1%')}, same replica "
                      f"{fmt(s['affinity'], '.0%')}, replicas {len(s['replicas_used'])}", flush=True)
            base = results["levels"][f"pow2 c={c}"]
            for router in ("goodput", "goodput+prefix"):
                s = results["levels"][f"{router} c={c}"]
                results["comparison"][f"{router} c={c}"] = {
                    "ttft_p50_ratio": s["ttft_p50_ms"] / base["ttft_p50_ms"] if s["ttft_p50_ms"] and base["ttft_p50_ms"] else None,
                    "tokens_per_s_ratio": s["output_tokens_per_s"] / base["output_tokens_per_s"],
                }
    results["compute_path"] = results["levels"][f"pow2 c={levels[0]}"]["compute_path"]
    results["prefill_headroom"] = prefill_headroom(results, levels)
    table = report(args, results, levels)
    print(table)
    write_report(args.out, table, results)


def rerender(path: Path) -> str:
    """The tables of a saved run (``--from-json``), its prefill headroom computed from its records."""
    results = json.loads(path.read_text())
    # runs saved before an option existed ran at its default
    args = argparse.Namespace(**{"num_kv_blocks": None, "system_prompt": "policy", "think_s": 0.0, "replicas": 2,
                                 **results["args"]})
    levels = sorted({int(k.rsplit("c=", 1)[1]) for k in results["levels"]})
    results["prefill_headroom"] = prefill_headroom(results, levels)
    return report(args, results, levels)


if __name__ == "__main__":
    main()
