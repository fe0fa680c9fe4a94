"""Decode-step time against draft-tree width at batch 1, in process: what a tree row costs here.

The engine decodes one prompt plainly, then speculatively at 1x1 (one drafted token: 2 rows) with a
prompt-lookup beam of ``k`` tokens that never occur in text (the vocabulary's last ids), so every
step verifies exactly ``2 + k`` rows whatever the drafter accepts. Widths are interleaved over
``--rounds`` rounds and each keeps the median step time of its decode steps (prefill excluded); the
engine's forward, LM head and drafting calls are timed the same way. The JSON is the cost table of
``benchmarks/tree_policies.py`` (``plain_ms``, ``tree_ms`` from 2 rows up, and ``draft_position_ms``: a 1x2 tree's step
against a 3-row 1x1 tree's).

Usage:
    python benchmarks/tree_costs.py --config configs/local.yaml --prompts ../shared/datasets/broad/dev.jsonl \\
        --max-width 8 --rounds 5 --out benchmarks/results/tree_costs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from collections import defaultdict
from pathlib import Path

import torch
from bench_report import write_report
from bench_spec import fixed_speculation, forced_table

from cluster.config import load_config
from cluster.replica.build import build_engine
from workers.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--prompts", help="JSONL prompts ('messages' or 'prompt'); the first one is decoded "
                    "(default: a 132-token synthetic prompt, the mean prompt length of broad/dev.jsonl's E2E set)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-width", type=int, default=8, help="widest tree measured (rows, root included)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/tree_costs")
    args = ap.parse_args()
    if args.max_width < 2:
        ap.error("--max-width must be at least 2 (the root and one drafted token)")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.max_tokens < 8:
        ap.error("--max-tokens must be at least 8 (the first two steps are left out of each median)")

    cfg = load_config(args.config)
    extra = args.max_width - 2
    cfg.speculation = fixed_speculation(cfg.speculation, num_beams=1, draft_len_per_beam=1,
                                        prompt_lookup_num_tokens=max(extra, 1), prompt_lookup_max_num_tokens=None)
    engine = build_engine(cfg)
    if engine.drafter is None:
        raise SystemExit(f"{args.config}: no drafter (drafter.path), nothing to measure")
    if args.prompts:
        first = json.loads(next(line for line in Path(args.prompts).read_text().split("\n") if line.strip()))
        ids = engine.encode_chat(first["messages"]) if "messages" in first else engine.encode_prompt(first["prompt"])
    else:
        ids = list(range(1000, 1132))
    vocab = engine.executor.embed_weight.shape[0]
    width = {"lookup": 0}
    runner = engine.runner
    runner._lookup_beam = types.MethodType(  # a beam of never-seen tokens, as long as asked and allowed
        lambda self, seq, n: [vocab - 1 - j for j in range(min(width["lookup"], n))], runner)

    parts: dict[str, list[float]] = defaultdict(list)

    def timed(obj, name: str, part: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[part].append(time.perf_counter() - t)
        setattr(obj, name, wrapper)

    timed(engine, "step", "step")
    timed(engine.executor, "forward", "forward")
    timed(engine.executor, "logits", "LM head")
    timed(runner, "_draft", "drafting")

    def run(mode: str) -> dict[str, float]:
        parts.clear()
        for _ in engine.generate(ids, SamplingParams(max_tokens=args.max_tokens), mode):
            pass
        skip = 2  # the prefill step and the first decode step
        return {p: statistics.median(v[skip:]) * 1e3 for p, v in parts.items() if len(v) > skip}

    # name, mode, lookup tokens, draft shape; "3, 2 drafted" is a 1x2 tree (rows as "3", one more draft position)
    configs = [("plain", "plain", 0, (1, 1))] + [(f"{2 + k}", "spec", k, (1, 1)) for k in range(extra + 1)]
    configs.append(("3, 2 drafted", "spec", 0, (1, 2)))
    run("plain")
    run("spec")
    rounds: dict[str, list[dict]] = defaultdict(list)
    for r in range(args.rounds):
        for name, mode, k, shape in configs:
            width["lookup"] = k
            with forced_table(engine, shape, cfg.engine.max_batch_size):
                rounds[name].append(run(mode))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {rounds[n][-1]['step']:.2f}" for n, *_ in configs),
              flush=True)
    med = {name: {p: statistics.median(x[p] for x in rs) for p in rs[0]} for name, rs in rounds.items()}
    plain = med["plain"]["step"]
    threads = torch.get_num_threads()
    lines = [f"compute path {engine.compute_path}, threads {threads}, "
             f"prompt {len(ids)} tokens, max_tokens {args.max_tokens}, median of {args.rounds} interleaved rounds",
             "", "| rows verified | step ms | vs plain | forward ms | LM head ms | drafting ms |", "|---|---|---|---|---|---|"]
    for name, *_ in configs:
        m = med[name]
        lines.append(f"| {'1 (plain)' if name == 'plain' else name} | {m['step']:.2f} | {m['step'] / plain:.2f}x | "
                     f"{m.get('forward', 0):.2f} | {m.get('LM head', 0):.2f} | {m.get('drafting', 0):.2f} |")
    lines += ["", f"A second drafted position: {med['3, 2 drafted']['step'] - med['3']['step']:+.2f} ms "
              "(a 1x2 tree against 1x1 plus one lookup token, both 3 rows)."]
    table = "\n".join(lines)
    print(table)
    write_report(args.out, table, {
        "plain_ms": plain, "tree_ms": [med[str(r)]["step"] for r in range(2, args.max_width + 1)],
        "draft_position_ms": max(0.0, med["3, 2 drafted"]["step"] - med["3"]["step"]),
        "parts_ms": med, "rounds": rounds, "prompt_tokens": len(ids), "max_tokens": args.max_tokens,
        "compute_path": engine.compute_path, "num_threads": threads, "config": args.config})


if __name__ == "__main__":
    main()
