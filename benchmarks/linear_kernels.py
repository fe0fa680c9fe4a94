"""Cost of SmolLM2-135M's linear layers per decoding step, by row count (1 = plain decoding at
batch 1; 3-33 = ReDrafter trees and batches): torch's float32 GEMM with the row-major and the
input-major weight layout, our packed float32 kernel (``workers/kernels``), our GGUF kernels as the
default model ships (Q4_1 layers, Q8_0 LM head; random blocks of the real shapes), each of ours in
its AVX-512 and AVX2 build where the CPU has both, and torch bfloat16.

One step = the 30 layers' qkv, o, gate_up and down projections plus the LM head. Random weights of
the real shapes. The variants run interleaved, round after round, and the median over rounds is
kept, so a noisy neighbour on the VM slows all of them alike.

Usage: python benchmarks/linear_kernels.py [--rows 1,2,3,5,9,17,33,64] [--rounds 9] [--only packed,gguf]
       [--threads 1 --clock cpu]  (CPU time: kernel ratios on a shared machine)
(prints a Markdown table, writes benchmarks/results/linear_kernels.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_clock import add_clock_option, step_clock

import numpy as np

from workers.kernels import build
from workers.kernels.packed_linear import PackedLinear
from workers.kernels.quant_linear import QuantLinear

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]


def step_fns(dtype: torch.dtype) -> dict[str, list]:
    """Per variant, the list of ``x -> y`` layer functions of one step (layers, then LM head)."""
    weights = [torch.randn(o, i, dtype=dtype) / i**0.5 for _ in range(LAYERS) for o, i in SHAPES]
    weights.append(torch.randn(VOCAB, HIDDEN, dtype=dtype))
    if dtype == torch.bfloat16:
        return {"torch bfloat16": [lambda x, w=w: F.linear(x, w) for w in weights]}
    input_major = [w.t().contiguous().t() for w in weights]
    out = {
        "torch float32 row-major": [lambda x, w=w: F.linear(x, w) for w in weights],
        "torch float32 input-major": [lambda x, w=w: F.linear(x, w) for w in input_major],
    }
    blocks = [random_blocks("Q4_1", o, i) for _ in range(LAYERS) for o, i in SHAPES] + [random_blocks("Q8_0", VOCAB, HIDDEN)]
    for isa in build.supported_isas():
        os.environ["RDSERVE_CPU_ISA"] = isa  # the modules keep the variant they were built with
        out[f"packed float32 ({isa})"] = [PackedLinear(w) for w in weights]
        out[f"gguf Q4_1, Q8_0 head ({isa})"] = [QuantLinear("Q8_0" if b.shape[0] == VOCAB else "Q4_1", b, i)
                                               for b, (_, i) in zip(blocks, [*SHAPES * LAYERS, (VOCAB, HIDDEN)])]
    os.environ.pop("RDSERVE_CPU_ISA")
    return out


def random_blocks(fmt: str, n: int, k: int) -> np.ndarray:
    """Random GGUF blocks ``[n, k / 32 * bytes]`` with scales of a trained model's magnitude."""
    rng = np.random.default_rng(n * k)
    size = {"Q4_1": 20, "Q8_0": 34}[fmt]
    b = rng.integers(0, 256, (n, k // 32, size), dtype=np.uint8)
    b[..., 0:2] = np.full((n, k // 32, 1), 0.01, np.float16).view(np.uint8)
    if fmt == "Q4_1":
        b[..., 2:4] = np.full((n, k // 32, 1), -0.08, np.float16).view(np.uint8)
    return b.reshape(n, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch (and kernel) threads")
    ap.add_argument("--rows", default="1,2,3,5,9,17,33,64", help="row counts to time, comma-separated")
    ap.add_argument("--rounds", type=int, default=9, help="timed rounds (after one warm-up round)")
    ap.add_argument("--out", default="benchmarks/results/linear_kernels.json", help="JSON output path")
    ap.add_argument("--only", default=None, help="time only variants whose name contains one of these, comma-separated")
    add_clock_option(ap)
    args = ap.parse_args()
    clock = step_clock(ap, args)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    variants = {**step_fns(torch.float32), **step_fns(torch.bfloat16)}
    if args.only:
        variants = {n: f for n, f in variants.items() if any(s in n for s in args.only.split(","))}
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        inputs = {(m, dt): {i: torch.randn(m, i, dtype=dt) for i in (HIDDEN, INTER)}
                  for m in rows for dt in (torch.float32, torch.bfloat16)}
        for r in range(args.rounds + 1):  # round 0 warms up
            for m in rows:
                for name, fns in variants.items():
                    x = inputs[(m, torch.bfloat16 if "bfloat16" in name else torch.float32)]
                    t0 = clock()
                    for fn, (o, i) in zip(fns, [s for _ in range(LAYERS) for s in SHAPES] + [(VOCAB, HIDDEN)]):
                        fn(x[i])
                    if r:
                        times.setdefault((name, m), []).append((clock() - t0) * 1e3)
    names = list(variants)
    results = [{"variant": n, "rows": m, "step_ms": statistics.median(times[(n, m)])} for m in rows for n in names]
    lines = [f"threads {args.threads}, median of {args.rounds} interleaved rounds, ms per step (30 layers + LM head), "
             f"{args.clock} clock", "",
             "| rows | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for m in rows:
        lines.append(f"| {m} | " + " | ".join(f"{statistics.median(times[(n, m)]):.1f}" for n in names) + " |")
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "rounds": args.rounds, "clock": args.clock, "results": results},
                              indent=1))


if __name__ == "__main__":
    main()
