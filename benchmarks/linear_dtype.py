"""Cost of SmolLM2-135M's linear layers for the row counts of decoding and tree verification,
float32 vs bfloat16, with the weight layout the loader uses for each (input-major for float32,
row-major for bfloat16).

One "forward" = the 30 layers' qkv, o, gate_up and down projections; the LM head is timed apart.
Random weights of the real shapes; median of 15 repeats after 3 warm-up runs.

Usage: python benchmarks/linear_dtype.py [--threads 2] (prints a table, writes
benchmarks/results/linear_dtype.json)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def median_ms(fn, repeats: int = 15) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,3,5,9,17,33,64")
    ap.add_argument("--out", default="benchmarks/results/linear_dtype.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            weights = [torch.randn(o, i, dtype=dtype) for o, i in SHAPES for _ in range(LAYERS)]
            head = torch.randn(VOCAB, HIDDEN, dtype=dtype)
            if dtype == torch.float32:  # workers/kernels/packed_linear.py: use_input_major_weights
                weights = [w.t().contiguous().t() for w in weights]
                head = head.t().contiguous().t()
            for m in (int(r) for r in args.rows.split(",")):
                x = {i: torch.randn(m, i, dtype=dtype) for i in (HIDDEN, INTER)}
                layers = median_ms(lambda: [F.linear(x[w.shape[1]], w) for w in weights])
                lm_head = median_ms(lambda: F.linear(x[HIDDEN], head))
                results.append({"dtype": str(dtype).removeprefix("torch."), "rows": m, "layers_ms": layers,
                                "lm_head_ms": lm_head})
    print(f"threads {args.threads}\n\n| dtype | rows | 30 layers' projections ms | LM head ms |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['dtype']} | {r['rows']} | {r['layers_ms']:.1f} | {r['lm_head_ms']:.1f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
