"""Cost of SmolLM2-135M's GGUF linear layers per decoding step by row count, float32 activations
(the default Q4_1 and Q8_0 kernels) against int8 activations (``QuantLinear.enable_int8_activations``,
``workers/kernels/vnni_gemm.h``). The Q8_0 LM head, part of each step, is also timed apart ("head").

One step = the 30 layers' qkv, o, gate_up and down projections plus the LM head, on random blocks of
the real shapes (``linear_kernels.random_blocks``). The two variants run interleaved, round after
round, and the median over rounds is kept. "per row" is (step at M - step at the first row count)
/ (M - that count).

Variants (``--variants``): ``float32`` (float32 activations), ``int8`` (the best int8 kernel here:
amx, vnni or avx2) and ``int8-amx``, ``int8-vnni``, ``int8-avx2`` (that kernel forced; all three
compute the same bits).

Usage: python benchmarks/int8_activations.py [--rows 1,2,3,5,7,9,16] [--rounds 9] [--threads 2]
       [--threads 1 --clock cpu]  (CPU time: kernel costs on a shared machine)
       [--variants int8-vnni,int8-amx --rows 1,4,8,12,16,17,24,32]  (AMX against VNNI)
(prints a Markdown table, writes benchmarks/results/int8_activations.json)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from bench_clock import add_clock_option, step_clock
from linear_kernels import HIDDEN, INTER, LAYERS, SHAPES, VOCAB, random_blocks

from workers.kernels import build
from workers.kernels.quant_linear import INT8_KERNELS, QuantLinear, best_int8_kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch (and kernel) threads")
    ap.add_argument("--rows", default="1,2,3,5,7,9,16", help="row counts to time, comma-separated")
    ap.add_argument("--rounds", type=int, default=9, help="timed rounds (after one warm-up round)")
    ap.add_argument("--variants", default="float32,int8", help="comma-separated: float32, int8 (the best int8 "
                    f"kernel here), or int8-KERNEL with KERNEL one of {', '.join(INT8_KERNELS)}")
    ap.add_argument("--out", default="benchmarks/results/int8_activations.json", help="JSON output path")
    add_clock_option(ap)
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    for name in names:
        if name not in ("float32", "int8") and name.removeprefix("int8-") not in INT8_KERNELS:
            ap.error(f"--variants: unknown variant {name!r}")
    clock = step_clock(ap, args)
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [s for _ in range(LAYERS) for s in SHAPES]
    variants = {}
    for name in names:
        layers = [QuantLinear("Q4_1", random_blocks("Q4_1", o, i), i) for o, i in shapes]
        head = QuantLinear("Q8_0", random_blocks("Q8_0", VOCAB, HIDDEN), HIDDEN)
        if name != "float32":
            kernel = best_int8_kernel() if name == "int8" else name.removeprefix("int8-")
            for layer in [*layers, head]:
                layer.enable_int8_activations(kernel)
        variants[name] = layers, head
    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        inputs = {m: {i: torch.randn(m, i) for i in (HIDDEN, INTER)} for m in rows}
        for r in range(args.rounds + 1):  # round 0 warms up
            for m in rows:
                x = inputs[m]
                for name, (layers, head) in variants.items():
                    t0 = clock()
                    for fn, (_, i) in zip(layers, shapes):
                        fn(x[i])
                    t1 = clock()
                    head(x[HIDDEN])
                    t2 = clock()
                    if r:
                        times.setdefault((name, m), []).append((t2 - t0) * 1e3)
                        times.setdefault((f"{name} head", m), []).append((t2 - t1) * 1e3)
    med = {key: statistics.median(v) for key, v in times.items()}
    machine = f"{build.cpu_model()}, kernel build {build.active_isa()}, best int8 kernel {best_int8_kernel()}"
    lines = [f"{machine}; threads {args.threads}, median of {args.rounds} interleaved rounds, ms per step (30 "
             f"layers + Q8_0 LM head), {args.clock} clock", "",
             "| rows | " + " | ".join(f"{n}" for n in names) + " | " + " | ".join(f"{n} head" for n in names)
             + " | " + " | ".join(f"{n} per row" for n in names) + " |",
             "|---|" + "---|" * (3 * len(names))]
    for m in rows:
        cells = [f"{med[(n, m)]:.2f}" for n in names] + [f"{med[(n + ' head', m)]:.2f}" for n in names]
        cells += [f"{(med[(n, m)] - med[(n, rows[0])]) / (m - rows[0]):.2f}" if m > rows[0] else ""
                  for n in names]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "threads": args.threads, "rounds": args.rounds, "clock": args.clock,
                               "results": [{"variant": n, "rows": m, "ms": v} for (n, m), v in med.items()]}, indent=1))


if __name__ == "__main__":
    main()
