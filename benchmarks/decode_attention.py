r"""The decode-attention kernel alone (``workers/kernels/decode_attention.c``), by shape.

A decoding step's attention reads every visible key and value of every request once per layer;
with the default model (9 query heads sharing 3 key/value heads of 64 float32 dims, 30 layers) that
is 1.5 KB per layer and context token in float32 (46 MB per step at 1,024 tokens of context), half
that with ``engine.kv_cache_dtype: float16``. This times the kernel for the 30 layers of one step
(30 calls, each on its own layer's cache, so the caches do not stay in the CPU's caches as one
layer's would), on the model's head shape and a paged cache whose blocks lie in order, for each KV
cache dtype, and prints ms per step, the key/value bytes read per second and the query-row x key
multiply-adds per second. Cases (``BxTxL``: requests x new rows per request x context
tokens) cover plain decoding at batch 1 and 16, a draft tree's rows (the last ``T`` keys under a
causal mask, as a tree's own rows see only their ancestors) and a prompt chunk.

Usage:
    python benchmarks/decode_attention.py --cases 1x1x1024,1x7x1024,16x1x256,1x64x512 \
        --kv-dtypes float32,float16 --rounds 9 --out benchmarks/results/decode_attention
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_report import write_report

from workers.forward_batch import AttentionGroup
from workers.kernels import build
from workers.kernels.decode_attention import attend, plan

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
DTYPES = {"float32": torch.float32, "float16": torch.float16}


def _cases(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(","):
        try:
            B, T, L = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"a case is BxTxL (requests x rows x context), got {item!r}")
        if B < 1 or T < 1 or L < T or B * L > 1 << 20:
            raise argparse.ArgumentTypeError(f"case {item!r}: need B, T >= 1, L >= T and B x L <= 1,048,576")
        out.append((B, T, L))
    return out


def _dtypes(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in DTYPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"KV cache dtypes are {', '.join(DTYPES)}; got {text!r}")
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def case_inputs(B: int, T: int, L: int, seed: int = 0, kv_dtype: torch.dtype = torch.float32):
    """Queries ``[B*T, H, D]``, caches ``[B*L + 1, HKV, D]`` of ``kv_dtype``, the group: request b
    reads slots ``b*L .. b*L + L - 1`` (its blocks in order); row t sees keys ``0 .. L - T + t``."""
    g = torch.Generator().manual_seed(seed)
    rows = B * L + 1
    kc = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g).to(kv_dtype)
    vc = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g).to(kv_dtype)
    q = torch.randn(B * T, HEADS, HEAD_DIM, generator=g)
    slots = torch.arange(B * L).view(B, L)
    mask = torch.ones(T, L, dtype=torch.bool)
    mask[:, L - T:] = torch.ones(T, T, dtype=torch.bool).tril()
    mask = mask.expand(B, 1, T, L).contiguous()
    return q, kc, vc, AttentionGroup(0, B, T, slots, mask, decode=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--cases", type=_cases, default=_cases("1x1x1024,1x7x1024,1x17x1024,16x1x256,1x64x512"),
                    help="comma-separated BxTxL: requests x new rows each x context tokens (default: %(default)s)")
    ap.add_argument("--kv-dtypes", type=_dtypes, default=_dtypes("float32,float16"),
                    help="comma-separated KV cache dtypes, each timed per case (default: float32,float16)")
    ap.add_argument("--rounds", type=_positive, default=9, help="timed rounds per case; the median is reported")
    ap.add_argument("--threads", type=_positive, default=None, help="OpenMP threads (default: torch's)")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json (path without suffix)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    isa = build.load()
    rows_out = []
    for B, T, L in args.cases:
        layers = {name: [case_inputs(B, T, L, seed=i, kv_dtype=DTYPES[name]) for i in range(LAYERS)]
                  for name in args.kv_dtypes}
        plans = {name: [plan(isa, g, kc.shape[0]) for _, kc, _, g in layers[name]] for name in args.kv_dtypes}
        times: dict[str, list[float]] = {name: [] for name in args.kv_dtypes}
        for r in range(args.rounds + 1):  # dtypes alternate; round 0 is a warm-up
            for name in args.kv_dtypes:
                t0 = time.perf_counter()
                for (q, kc, vc, _), p in zip(layers[name], plans[name]):
                    attend(p, q, kc, vc)
                if r:
                    times[name].append(time.perf_counter() - t0)
        visible = int(plans[args.kv_dtypes[0]][0].mask.sum())  # (row, key) pairs per request x batch
        for name in args.kv_dtypes:
            sec = statistics.median(times[name])
            kv_bytes = LAYERS * B * L * KV_HEADS * HEAD_DIM * DTYPES[name].itemsize * 2
            products = LAYERS * HEADS * visible * HEAD_DIM * 2
            rows_out.append({"batch": B, "rows": T, "context": L, "kv_dtype": name, "ms_per_step_30_layers": sec * 1e3,
                             "kv_gb_per_s": kv_bytes / sec / 1e9, "g_mul_add_per_s": products / sec / 1e9})
    cpu = build.cpu_model()
    table = [f"Decode attention kernel, {cpu}, build {isa}, {torch.get_num_threads()} threads, median of {args.rounds}",
             "", "| B x T x L | KV cache | ms per step (30 layers) | KV GB/s | G multiply-adds/s |",
             "|---|---|---|---|---|"]
    for r in rows_out:
        table.append(f"| {r['batch']}x{r['rows']}x{r['context']} | {r['kv_dtype']} | "
                     f"{r['ms_per_step_30_layers']:.2f} | {r['kv_gb_per_s']:.1f} | {r['g_mul_add_per_s']:.1f} |")
    text = "\n".join(table)
    print(text)
    if args.out:
        write_report(args.out, text, {"cpu": cpu, "isa": isa, "threads": torch.get_num_threads(),
                                      "rounds": args.rounds, "cases": rows_out})


if __name__ == "__main__":
    main()
