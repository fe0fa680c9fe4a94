"""Overhead of rdserve's metrics on served output tokens/s, plain and speculative, at batch 1 and 16.

Serves CONFIG with ``rdserve up`` twice per round, once with ``observability.enabled: true`` and once
with ``false`` (the engine counts nothing, replicas record nothing), alternating on/off for
``--rounds`` rounds so machine drift hits both; for each ``rdserve.mode`` and closed-loop concurrency
the streaming load generator (``cluster.evaluation.loadgen``) measures output tokens/s (completion
tokens / wall time). Prints a Markdown table (overhead = 1 - on / off, means over the rounds) and
writes JSON. Target: under 2%. Needs a quiet machine: run-to-run noise on a shared one exceeds it.

Usage:
    python benchmarks/metrics_overhead.py --config configs/local.yaml \
        --prompts ../shared/datasets/broad/dev.jsonl --num-prompts 9 --max-tokens 128 \
        --concurrency 1,16 --rounds 3 --out benchmarks/results/metrics_overhead
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import yaml
from bench_ports import free_port
from bench_prompts import DATASETS, add_load_options, chat_prompts
from bench_report import write_report
from bench_serve import absolute_paths
from served_vs_engine import served_run, start_server, stop_server

from cluster.config import load_config


def variant_config(config: Path, enabled: bool, out_dir: Path) -> tuple[Path, int]:
    """CONFIG with ``observability.enabled`` set, free HTTP and metrics ports, and its relative paths made
    absolute (the copy lives elsewhere); returns the copy's path and HTTP port."""
    data = absolute_paths(yaml.safe_load(config.read_text()) or {}, config.resolve().parent)
    port = free_port()
    data.setdefault("serve", {})["port"] = port
    data["observability"] = {**(data.get("observability") or {}), "enabled": enabled, "metrics_port": free_port()}
    path = out_dir / f"metrics_{'on' if enabled else 'off'}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_config(path)  # fail here, naming the field, rather than in the server
    return path, port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml", help="rdserve config to serve")
    ap.add_argument("--prompts", default=str(DATASETS / "broad/dev.jsonl"), help="JSONL prompts (chat rows are used)")
    add_load_options(ap)
    ap.add_argument("--rounds", type=int, default=3, help="on/off alternations")
    ap.add_argument("--out", default="benchmarks/results/metrics_overhead", help="output path without suffix")
    args = ap.parse_args()

    model = load_config(args.config).model.name
    rows = chat_prompts(args.prompts, args.num_prompts)
    if not rows:
        raise SystemExit(f"{args.prompts}: no chat prompts")
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = args.modes.split(",")
    runs: dict = {"on": {}, "off": {}}
    with tempfile.TemporaryDirectory(prefix="rdserve-metrics-") as tmp:
        for rnd in range(args.rounds):
            for side in ("on", "off") if rnd % 2 == 0 else ("off", "on"):
                path, port = variant_config(Path(args.config), side == "on", Path(tmp))
                base_url = f"http://127.0.0.1:{port}"
                proc = start_server(str(path), base_url)
                try:
                    served_run(base_url, model, rows[:2], 2, min(2, max(levels)), "spec", 8)  # warm-up
                    for mode in modes:
                        for c in levels:
                            r = served_run(base_url, model, rows, max(len(rows), 2 * c), c, mode, args.max_tokens)
                            runs[side].setdefault(f"{mode} c={c}", []).append(r["output_throughput"])
                            print(f"round {rnd + 1} metrics {side} {mode} c={c}: {r['output_throughput']:.1f} tok/s",
                                  flush=True)
                finally:
                    stop_server(proc)
    lines = [f"config {args.config}, {len(rows)} prompts from {Path(args.prompts).name}, greedy, max_tokens "
             f"{args.max_tokens}, mean of {args.rounds} alternating on/off rounds", "",
             "| mode | concurrency | metrics on tok/s | metrics off tok/s | overhead |", "|---|---|---|---|---|"]
    results = {}
    for mode in modes:
        for c in levels:
            key = f"{mode} c={c}"
            on, off = statistics.mean(runs["on"][key]), statistics.mean(runs["off"][key])
            results[key] = {"on_tok_s": on, "off_tok_s": off, "overhead": 1 - on / off,
                            "runs_on": runs["on"][key], "runs_off": runs["off"][key]}
            lines.append(f"| {mode} | {c} | {on:.1f} | {off:.1f} | {100 * (1 - on / off):+.1f}% |")
    table = "\n".join(lines)
    print(table)
    write_report(args.out, table, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
