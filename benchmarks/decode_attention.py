r"""The decode-attention kernel alone (``workers/kernels/decode_attention.c``), by shape.

A decoding step's attention reads every visible key and value of every request once per layer;
with the default model (9 query heads sharing 3 key/value heads of 64 float32 dims, 30 layers) that
is 1.5 KB per layer and context token in float32 (46 MB per step at 1,024 tokens of context), half
that with ``engine.kv_cache_dtype: float16``, a bit over a quarter with ``int8``. This times the kernel
for the 30 layers of one step
(30 calls, each on its own layer's cache, so the caches do not stay in the CPU's caches as one
layer's would), on the model's head shape and a paged cache whose blocks lie in order, for each KV
cache dtype, and prints ms per step, the key/value bytes read per second and the query-row x key
multiply-adds per second. Cases (``BxTxL``: requests x new rows per request x context
tokens) cover plain decoding at batch 1 and 16, a draft tree's rows (the last ``T`` keys under a
causal mask, as a tree's own rows see only their ancestors) and a prompt chunk.

``--baseline REV`` also builds the kernel library with ``decode_attention.c`` and ``simd.h`` as
they were at git revision ``REV`` (the other sources and the flags as now) and times both,
interleaved (each first in every other round), on the same inputs, and says where their bits
differ: an A/B of a kernel change on one machine in one run (this VM's speed drifts by 10-40% over
minutes, so runs minutes apart do not compare).

Usage:
    python benchmarks/decode_attention.py --cases 1x1x1024,1x7x1024,16x1x256,1x64x512 \
        --kv-dtypes float32,float16 --rounds 9 --out benchmarks/results/decode_attention
    python benchmarks/decode_attention.py --baseline HEAD~1 --out /tmp/decode_attention_ab
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench_report import write_report

from workers.forward_batch import AttentionGroup
from workers.kernels import build
from workers.kernels.decode_attention import attend, plan
from workers.kv_cache import quantize_rows

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}


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
    kc, vc = (torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    kc, vc = (quantize_rows(x) if kv_dtype == torch.int8 else x.to(kv_dtype) for x in (kc, vc))
    q = torch.randn(B * T, HEADS, HEAD_DIM, generator=g)
    slots = torch.arange(B * L).view(B, L)
    mask = torch.ones(T, L, dtype=torch.bool)
    mask[:, L - T:] = torch.ones(T, T, dtype=torch.bool).tril()
    mask = mask.expand(B, 1, T, L).contiguous()
    return q, kc, vc, AttentionGroup(0, B, T, slots, mask, decode=True)


def baseline_kernel(rev: str, isa: str, int8: bool = False):
    """``rd_decode_attention`` of a kernel library built as :mod:`workers.kernels.build` builds it (all
    sources, the same flags), with ``decode_attention.c`` and ``simd.h`` as they were at git
    revision ``rev``: a whole library, so that both sides of the A/B are laid out alike.

    Raises:
        SystemExit: ``rev`` unknown to git, or the library does not compile (the message says which).
    """
    tmp = Path(tempfile.mkdtemp(prefix="rdserve-attention-"))
    for path in (*build.SOURCES, *build.HEADERS):
        (tmp / path.name).write_text(path.read_text())
    for name in ("decode_attention.c", "simd.h"):
        got = subprocess.run(["git", "show", f"{rev}:workers/kernels/{name}"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent)
        if got.returncode:
            raise SystemExit(f"--baseline {rev}: cannot read workers/kernels/{name}: {got.stderr.strip()}")
        (tmp / name).write_text(got.stdout)
    text = (tmp / "decode_attention.c").read_text()
    if "kv_half" not in text and "kv_kind" not in text:
        raise SystemExit(f"--baseline {rev}: that kernel predates float16 caches (no kv_half argument); "
                         "give a revision at or after 70a9db7")
    if int8 and "KV_I8" not in text:
        raise SystemExit(f"--baseline {rev}: that kernel reads no int8 caches; time --kv-dtypes without int8 "
                         "against it")
    lib = tmp / "baseline.so"
    cmd = [*build._compiler(), *build.FLAGS, *build.ISA_FLAGS[isa], *(str(tmp / p.name) for p in build.SOURCES),
           "-o", str(lib)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"--baseline {rev}: the kernel library does not compile:\n{done.stderr[-2000:]}")
    fn = ctypes.CDLL(str(lib)).rd_decode_attention
    fn.argtypes, fn.restype = build.kernel(isa, "rd_decode_attention").argtypes, ctypes.c_int
    return fn


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--cases", type=_cases, default=_cases("1x1x1024,1x7x1024,1x17x1024,16x1x256,1x64x512"),
                    help="comma-separated BxTxL: requests x new rows each x context tokens (default: %(default)s)")
    ap.add_argument("--kv-dtypes", type=_dtypes, default=_dtypes("float32,float16"),
                    help="comma-separated KV cache dtypes (float32, float16, int8), each timed per case "
                    "(default: float32,float16)")
    ap.add_argument("--rounds", type=_positive, default=9, help="timed rounds per case; the median is reported")
    ap.add_argument("--threads", type=_positive, default=None, help="OpenMP threads (default: torch's)")
    ap.add_argument("--baseline", metavar="REV", default=None,
                    help="also time the kernel of git revision REV (e.g. HEAD~1), interleaved: an A/B in one run")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json (path without suffix)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    isa = build.load()
    kernels = {"": None}
    if args.baseline:
        kernels = {"": None, args.baseline: baseline_kernel(args.baseline, isa, "int8" in args.kv_dtypes)}
    rows_out = []
    for B, T, L in args.cases:
        layers = {name: [case_inputs(B, T, L, seed=i, kv_dtype=DTYPES[name]) for i in range(LAYERS)]
                  for name in args.kv_dtypes}
        plans = {name: [plan(isa, g, kc.shape[0]) for _, kc, _, g in layers[name]] for name in args.kv_dtypes}
        runs = [(name, rev) for name in args.kv_dtypes for rev in kernels]
        for name, rev in runs:  # say where the baseline computes other bits than this kernel
            q, kc, vc, _ = layers[name][0]
            if rev and not torch.equal(attend(plans[name][0], q, kc, vc), attend(plans[name][0], q, kc, vc, kernels[rev])):
                print(f"note: {B}x{T}x{L} {name}: the kernel of {rev} returns other bits than this one")
        times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
        for r in range(args.rounds + 1):  # dtypes and kernels alternate, in turn first; round 0 is a warm-up
            for name, rev in (runs if r % 2 else runs[::-1]):
                t0 = time.perf_counter()
                for (q, kc, vc, _), p in zip(layers[name], plans[name]):
                    attend(p, q, kc, vc, kernels[rev])
                if r:
                    times[name, rev].append(time.perf_counter() - t0)
        visible = int(plans[args.kv_dtypes[0]][0].mask.sum())  # (row, key) pairs per request x batch
        for name, rev in runs:
            sec = statistics.median(times[name, rev])
            row_bytes = HEAD_DIM + 4 if name == "int8" else HEAD_DIM * DTYPES[name].itemsize  # int8: + scale
            kv_bytes = LAYERS * B * L * KV_HEADS * row_bytes * 2
            products = LAYERS * HEADS * visible * HEAD_DIM * 2
            row = {"batch": B, "rows": T, "context": L, "kv_dtype": name, "kernel": rev or "this",
                   "ms_per_step_30_layers": sec * 1e3, "kv_gb_per_s": kv_bytes / sec / 1e9,
                   "g_mul_add_per_s": products / sec / 1e9}
            if rev:
                row["this_vs_baseline"] = statistics.median(times[name, ""]) / sec
            rows_out.append(row)
    cpu = build.cpu_model()
    ab = f"; kernel of {args.baseline} alongside (interleaved)" if args.baseline else ""
    table = [f"Decode attention kernel, {cpu}, build {isa}, {torch.get_num_threads()} threads, median of {args.rounds}{ab}",
             "", "| B x T x L | KV cache | kernel | ms per step (30 layers) | KV GB/s | G multiply-adds/s | time, this / baseline |",
             "|---|---|---|---|---|---|---|"]
    for r in rows_out:
        ratio = f"{r['this_vs_baseline']:.2f}x" if "this_vs_baseline" in r else ""
        table.append(f"| {r['batch']}x{r['rows']}x{r['context']} | {r['kv_dtype']} | {r['kernel']} | "
                     f"{r['ms_per_step_30_layers']:.2f} | {r['kv_gb_per_s']:.1f} | {r['g_mul_add_per_s']:.1f} | {ratio} |")
    text = "\n".join(table)
    print(text)
    if args.out:
        write_report(args.out, text, {"cpu": cpu, "isa": isa, "threads": torch.get_num_threads(),
                                      "rounds": args.rounds, "baseline": args.baseline, "cases": rows_out})


if __name__ == "__main__":
    main()
