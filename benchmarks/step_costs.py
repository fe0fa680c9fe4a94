"""Cost of one decoding step at batch 1 on the default model: plain step, ReDrafter drafting, and
tree verification, for several beam shapes; and the tokens per step each shape needs to break even
with plain decoding.

Usage: python benchmarks/step_costs.py [--config configs/local.yaml] [--context 300] [--repeats 15]
Prints a Markdown table and writes benchmarks/results/step_costs.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from cluster.config import load_config
from cluster.local_engine import build_engine
from workers.redrafter.beam_search import draft_beams
from workers.sampling import SamplingParams
from workers.speculative_step import plain_step, speculative_step

SHAPES = [(1, 2), (1, 4), (2, 2), (2, 3), (2, 4), (3, 3), (3, 4), (4, 3), (4, 4), (4, 5), (6, 4), (8, 4)]


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--context", type=int, default=300, help="tokens already in the KV cache")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="benchmarks/results/step_costs.json")
    args = ap.parse_args()
    engine = build_engine(load_config(args.config))
    model, drafter = engine.model, engine.drafter
    greedy = SamplingParams()
    L = args.context
    executor = engine.executor
    ids = torch.randint(0, model.config.vocab_size, (L,)).tolist()
    hidden = engine._prefill(ids)

    def plain():
        plain_step(executor, L, ids[-1], greedy, None)

    plain_ms = median_ms(plain, args.repeats)
    rows = []
    for nb, dl in SHAPES:
        draft_ms = median_ms(lambda: draft_beams(drafter, model.model.embed_tokens, hidden, ids[-1], nb, dl), args.repeats)
        # worst case: no shared prefixes, 1 + nb * dl tree nodes
        beams = torch.cat([torch.full((nb, 1), ids[-1]), torch.randint(0, 1000, (nb, dl))], dim=1)

        def verify():
            speculative_step(executor, L, beams, greedy, None)

        verify_ms = median_ms(verify, args.repeats)
        step = draft_ms + verify_ms
        rows.append({"num_beams": nb, "draft_len_per_beam": dl, "tree_nodes": 1 + nb * dl, "draft_ms": draft_ms,
                     "verify_ms": verify_ms, "step_ms": step, "break_even_tokens_per_step": step / plain_ms})
    print(f"plain step: {plain_ms:.1f} ms (context {L}, threads {torch.get_num_threads()})\n")
    print("| num_beams | draft_len_per_beam | tree nodes (max) | draft ms | verify ms | break-even tokens/step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['num_beams']} | {r['draft_len_per_beam']} | {r['tree_nodes']} | {r['draft_ms']:.1f} | "
              f"{r['verify_ms']:.1f} | {r['break_even_tokens_per_step']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"plain_ms": plain_ms, "context": L, "threads": torch.get_num_threads(), "shapes": rows}, indent=1))


if __name__ == "__main__":
    main()
