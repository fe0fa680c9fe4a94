"""Throughput and step time versus batch size, plain vs ReDrafter speculative decoding.

For each batch size B: B held-out prompts (never used for drafter training; cycled when B exceeds
them) are submitted at once and decoded to ``--max-tokens`` tokens each (greedy, EOS ignored so
every request emits the same count) with in-flight batching; output tokens/s is total output tokens
over wall time, step time is the median generation-only iteration. Speculative runs use one fixed
draft-tree shape at every batch size (``speculation.policy: fixed``, whatever the config's policy), so the crossover where
speculation stops paying is visible.

Usage:
    python benchmarks/batch_scaling.py --config configs/local.yaml --batch-sizes 1,2,4,8,16,32,64 \
        --max-tokens 64 --out benchmarks/results/batch_scaling
Prints a Markdown table and writes JSON and Markdown.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench_prompts import DATASETS
from bench_report import write_report
from bench_spec import fixed_speculation

from cluster.config import load_config
from cluster.replica.build import build_engine
from workers.engine import Engine
from workers.sampling_params import SamplingParams
from workers.training.prompt_sources import build_prompts, require_datasets


def run_batch(engine: Engine, prompts: list[list[int]], max_tokens: int, mode: str) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    steps_s, out_tokens, accepted, gen_steps = [], 0, 0, 0
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"b{i}", ids, params, mode)
    finals = {}
    while engine.num_unfinished:
        generation_only = not engine.scheduler.waiting and not any(s.is_prefill for s in engine.scheduler.running)
        ts = time.perf_counter()
        deltas = engine.step()
        if generation_only:
            steps_s.append(time.perf_counter() - ts)
        for d in deltas:
            if d.finished:
                finals[d.request_id] = d
    wall = time.perf_counter() - t0
    for d in finals.values():
        out_tokens += d.completion_tokens
        accepted += d.accepted_draft_tokens
        gen_steps += d.num_steps
    return {
        "wall_s": wall, "output_tokens": out_tokens, "tokens_per_s": out_tokens / wall,
        "step_ms": statistics.median(steps_s) * 1e3 if steps_s else None,
        "tokens_per_step": (accepted + gen_steps) / gen_steps if gen_steps else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--datasets-dir", default=str(DATASETS))
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", help="override engine.dtype")
    ap.add_argument("--num-beams", type=int, help="override speculation.num_beams (the fixed spec shape)")
    ap.add_argument("--draft-len-per-beam", type=int, help="override speculation.draft_len_per_beam")
    ap.add_argument("--out", default="benchmarks/results/batch_scaling")
    args = ap.parse_args()

    batches = [int(b) for b in args.batch_sizes.split(",")]
    cfg = load_config(args.config)
    update = {"max_batch_size": max(batches)}
    if args.dtype:
        update["dtype"] = args.dtype
    cfg.engine = cfg.engine.model_copy(update=update)
    # the fixed policy: num_beams x draft_len_per_beam at every batch size up to max_batch_size
    shape_args = {k: getattr(args, k) for k in ("num_beams", "draft_len_per_beam") if getattr(args, k)}
    cfg.speculation = fixed_speculation(cfg.speculation, **shape_args)
    engine = build_engine(cfg)
    threads = torch.get_num_threads()  # the engine's count; adaptive threads may move it between steps
    e = cfg.engine
    shape = (cfg.speculation.num_beams, cfg.speculation.draft_len_per_beam)
    prompts = [engine.encode_chat(p["messages"]) for p in build_prompts(require_datasets(Path(args.datasets_dir)), "heldout")]
    prompts = [p for p in prompts if len(p) + args.max_tokens <= engine.max_seq_len]
    run_batch(engine, prompts[:2], 8, "spec")  # warm-up
    results = []
    for b in batches:
        chosen = [prompts[i % len(prompts)] for i in range(b)]
        row = {"batch_size": b, "mean_prompt_tokens": sum(map(len, chosen)) / b}
        for mode in ("plain", "spec"):
            row[mode] = run_batch(engine, chosen, args.max_tokens, mode)
        row["speedup"] = row["spec"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
        results.append(row)
        print(f"batch {b}: plain {row['plain']['tokens_per_s']:.1f} tok/s, spec {row['spec']['tokens_per_s']:.1f} "
              f"tok/s ({row['speedup']:.2f}x)", flush=True)
    crossover = next((r["batch_size"] for r in results if r["speedup"] < 1.0), None)
    lines = [
        f"model dtype {e.dtype}, threads {threads}, spec shape {shape[0]}x{shape[1]}, "
        f"max_tokens {args.max_tokens} (EOS ignored), prompts: held-out chat/code/math",
        "",
        "| batch | plain tokens/s | plain step ms | spec tokens/s | spec step ms | spec tokens/step | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p, s = r["plain"], r["spec"]
        lines.append(f"| {r['batch_size']} | {p['tokens_per_s']:.1f} | {p['step_ms']:.0f} | {s['tokens_per_s']:.1f} | "
                     f"{s['step_ms']:.0f} | {s['tokens_per_step']:.2f} | {r['speedup']:.2f}x |")
    lines += ["", f"speculation stops paying at batch size: {crossover or 'not within the measured range'}"]
    table = "\n".join(lines)
    print(table)
    write_report(args.out, table, {"config": str(args.config), "dtype": e.dtype, "shape": shape,
                                   "max_tokens": args.max_tokens, "threads": threads,
                                   "crossover_batch_size": crossover, "rows": results})


if __name__ == "__main__":
    main()
