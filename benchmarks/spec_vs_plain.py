"""Plain vs ReDrafter speculative decoding at batch 1, end to end through the engine.

Same held-out prompts (never used for drafter training), same threads, greedy; each prompt is
decoded ``--runs`` times per mode and the median wall time is kept. Prefix caching is off (both
modes share one engine; a cached prompt would skip the second mode's prefill). Prints a Markdown table and
writes JSON.

In float32 on CPU the engine runs its linear layers on the packed kernels (``workers/kernels``);
plain decoding is also timed with torch's own GEMM (``RDSERVE_CPU_KERNELS=0``, input-major
weights), and the speedup is taken against the faster of the two plain figures.

With ``--policy auto`` the spec engine keeps the config's speculation policy (the goodput model
choosing plain or a tree shape each iteration, as a served replica does) instead of one fixed
shape, and the table adds the shapes it chose (share of decode iterations). The compute path and
CPU are printed with the figures.

Usage:
    python benchmarks/spec_vs_plain.py --config configs/local.yaml --prompts-per-category 6 \
        --max-tokens 128 --runs 3 --out benchmarks/results/spec_vs_plain
    python benchmarks/spec_vs_plain.py --policy auto --prompts ../shared/datasets/broad/dev.jsonl \
        --prompts-per-category 4 --max-tokens 192 --runs 1 --out benchmarks/results/spec_vs_plain_auto
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from bench_prompts import DATASETS
from bench_report import write_report
from bench_spec import fixed_speculation

from cluster.config import load_config
from cluster.replica.build import build_engine
from workers.engine import Engine
from workers.kernels.build import cpu_model
from workers.sampling_params import SamplingParams
from workers.training.prompt_sources import build_prompts, first_per_category, require_datasets


def run_once(engine: Engine, ids: list[int], mode: str, max_tokens: int):
    t0 = time.perf_counter()
    last = None
    for last in engine.generate(ids, SamplingParams(max_tokens=max_tokens), mode):
        pass
    return time.perf_counter() - t0, last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--datasets-dir", default=str(DATASETS))
    ap.add_argument("--prompts", help="JSONL prompts ('messages' or 'prompt', 'category'), e.g. "
                    "../shared/datasets/broad/dev.jsonl; default: rdserve's held-out chat/code/math prompts")
    ap.add_argument("--prompts-per-category", type=int, default=6)
    ap.add_argument("--no-torch-plain", action="store_true", help="skip plain decoding on torch's GEMM (float32)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-beams", type=int)
    ap.add_argument("--draft-len-per-beam", type=int)
    ap.add_argument("--dtype", help="override engine.dtype")
    ap.add_argument("--policy", choices=("fixed", "auto"), default="fixed",
                    help="fixed: one shape (the config's or --num-beams/--draft-len-per-beam); auto: the config's "
                    "speculation policy, shapes chosen per iteration")
    ap.add_argument("--out", default="benchmarks/results/spec_vs_plain")
    args = ap.parse_args()

    cfg = load_config(args.config)
    if args.dtype:
        cfg.engine = cfg.engine.model_copy(update={"dtype": args.dtype})
    # plain and spec run the same prompts on one engine: with the prefix cache on, every mode after
    # the first would find its prompt cached and skip its prefill (a bias of up to ~10% in the ratio)
    cfg.engine = cfg.engine.model_copy(update={"enable_prefix_caching": False})
    shape = {"num_beams": args.num_beams, "draft_len_per_beam": args.draft_len_per_beam}
    if args.policy == "fixed":  # measure the num_beams x draft_len_per_beam shape, not the config's policy
        cfg.speculation = fixed_speculation(cfg.speculation, **{k: v for k, v in shape.items() if v})
    elif any(shape.values()):
        ap.error("--num-beams / --draft-len-per-beam fix a shape: not with --policy auto")
    e = cfg.engine
    engine = build_engine(cfg)
    engines = {"plain": engine, "spec": engine}
    chosen: Counter = Counter()  # decode iterations of the spec runs by the shape the policy chose
    counting = [False]
    observe = engine.spec_policy.observe_step  # called once per generation-only iteration with its shape

    def count(spec_shape, *rest):
        if counting[0]:
            chosen["plain" if not spec_shape else f"{spec_shape[0]}x{spec_shape[1]}"] += 1
        return observe(spec_shape, *rest)

    engine.spec_policy.observe_step = count
    if e.dtype == "float32" and e.device == "cpu" and not args.no_torch_plain:
        os.environ["RDSERVE_CPU_KERNELS"] = "0"
        engines["plain_torch"] = build_engine(cfg)
        os.environ.pop("RDSERVE_CPU_KERNELS")
    if args.prompts:
        source = [json.loads(line) for line in Path(args.prompts).read_text().split("\n") if line.strip()]
    else:
        source = build_prompts(require_datasets(Path(args.datasets_dir)), "heldout")
    by_cat = first_per_category(source, args.prompts_per_category)
    prompts = [p for ps in by_cat.values() for p in ps]

    def encode(p):
        return engine.encode_chat(p["messages"]) if "messages" in p else engine.encode_prompt(p["prompt"])

    warm = encode(prompts[0])
    for mode, eng in engines.items():
        run_once(eng, warm, mode.removesuffix("_torch"), 16)
    rows = []
    for p in tqdm(prompts, desc="prompts"):
        ids = encode(p)
        row = {"category": p["category"], "prompt_tokens": len(ids)}
        for mode, eng in engines.items():
            times, last = [], None
            for _ in range(args.runs):
                counting[0] = mode == "spec"
                dt, last = run_once(eng, ids, mode.removesuffix("_torch"), args.max_tokens)
                counting[0] = False
                times.append(dt)
            row[mode] = {
                "latency_s": statistics.median(times), "completion_tokens": last.completion_tokens,
                "num_steps": last.num_steps, "accepted_draft_tokens": last.accepted_draft_tokens,
            }
        if e.dtype == "float32":  # lossless; in bfloat16 the two paths round differently and may diverge
            assert row["plain"]["completion_tokens"] == row["spec"]["completion_tokens"]
        rows.append(row)

    def summarize(sel):
        out = {}
        for mode in engines:
            toks = sum(r[mode]["completion_tokens"] for r in sel)
            secs = sum(r[mode]["latency_s"] for r in sel)
            steps = sum(r[mode]["num_steps"] for r in sel)
            acc = sum(r[mode]["accepted_draft_tokens"] for r in sel)
            out[mode] = {"tokens_per_s": toks / secs, "tokens_per_step": (acc + steps) / steps}
        plain = max(out[m]["tokens_per_s"] for m in out if m.startswith("plain"))
        out["speedup"] = out["spec"]["tokens_per_s"] / plain
        return out

    summary = {cat: summarize([r for r in rows if r["category"] == cat]) for cat in by_cat}
    summary["all"] = summarize(rows)
    total = sum(chosen.values())
    shares = ", ".join(f"{k} {v / total:.0%}" for k, v in chosen.most_common()) if total else "not recorded"
    policy = (f"policy auto ({engine.spec_selection.source}); shapes chosen (decode iterations): {shares}"
              if args.policy == "auto" else
              f"num_beams={engine.speculation.num_beams}, draft_len_per_beam={engine.speculation.draft_len_per_beam}")
    lines = [
        f"{cpu_model()}, compute path {engine.compute_path}; {policy}, dtype={e.dtype}, "
        f"threads={torch.get_num_threads()}, max_tokens={args.max_tokens}, runs={args.runs} (median)",
        "",
        "| category | prompts | plain tokens/s | plain, torch GEMM | spec tokens/s | speedup | spec tokens/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for cat, s in summary.items():
        n = len(rows) if cat == "all" else len(by_cat[cat])
        torch_plain = f"{s['plain_torch']['tokens_per_s']:.1f}" if "plain_torch" in s else "-"
        lines.append(
            f"| {cat} | {n} | {s['plain']['tokens_per_s']:.1f} | {torch_plain} | {s['spec']['tokens_per_s']:.1f} | "
            f"{s['speedup']:.2f}x | {s['spec']['tokens_per_step']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    write_report(args.out, table, {"summary": summary, "rows": rows, "args": vars(args), "cpu": cpu_model(),
                                   "compute_path": engine.compute_path, "shapes_chosen": dict(chosen)})


if __name__ == "__main__":
    main()
