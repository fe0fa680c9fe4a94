"""Sweep ReDrafter beam shapes at batch 1: tokens per step and end-to-end tokens/s vs plain.

Greedy decoding of held-out prompts (never used for drafter training), one engine, the beam shape
changed between runs. Use it to pick ``speculation.num_beams`` / ``speculation.draft_len_per_beam``.

Usage: python benchmarks/beam_shapes.py --config configs/local.yaml --prompts-per-category 3 \
    --max-tokens 96 --shapes 1x2,1x3,2x2,2x3,3x3,2x4,4x4
Prints a Markdown table and writes benchmarks/results/beam_shapes.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench_prompts import DATASETS
from bench_spec import forced_table

from cluster.config import load_config
from cluster.replica.build import build_engine
from workers.sampling_params import SamplingParams
from workers.training.prompt_sources import build_prompts, first_per_category, require_datasets


def decode_all(engine, prompts: list[list[int]], mode: str, max_tokens: int) -> dict:
    tokens = steps = accepted = 0
    t0 = time.perf_counter()
    for ids in prompts:
        for last in engine.generate(ids, SamplingParams(max_tokens=max_tokens), mode):
            pass
        tokens += last.completion_tokens
        steps += last.num_steps
        accepted += last.accepted_draft_tokens
    secs = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs,
            "tokens_per_step": (accepted + steps) / steps if steps else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--datasets-dir", default=str(DATASETS))
    ap.add_argument("--prompts-per-category", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--shapes", default="1x2,1x3,2x2,2x3,3x3,2x4,4x4")
    ap.add_argument("--out", default="benchmarks/results/beam_shapes.json")
    args = ap.parse_args()
    engine = build_engine(load_config(args.config))
    by_cat = first_per_category(build_prompts(require_datasets(Path(args.datasets_dir)), "heldout"), args.prompts_per_category)
    prompts = [engine.encode_chat(p["messages"]) for v in by_cat.values() for p in v]
    decode_all(engine, prompts[:1], "plain", 8)
    plain = decode_all(engine, prompts, "plain", args.max_tokens)
    rows = []
    for shape in args.shapes.split(","):
        nb, dl = (int(x) for x in shape.split("x"))
        with forced_table(engine, (nb, dl), 1):
            r = decode_all(engine, prompts, "spec", args.max_tokens)
        r.update(num_beams=nb, draft_len_per_beam=dl, speedup=r["tokens_per_s"] / plain["tokens_per_s"])
        rows.append(r)
        print(f"{shape}: {r['tokens_per_step']:.2f} tokens/step, {r['tokens_per_s']:.1f} tokens/s, x{r['speedup']:.2f}", flush=True)
    print(f"\nplain: {plain['tokens_per_s']:.1f} tokens/s ({len(prompts)} prompts, max_tokens {args.max_tokens})\n")
    print("| num_beams | draft_len_per_beam | tokens/step | tokens/s | speedup vs plain |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['num_beams']} | {r['draft_len_per_beam']} | {r['tokens_per_step']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"plain": plain, "shapes": rows, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
