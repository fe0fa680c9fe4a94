"""Iterations that carry a new prompt chunk beside decode rows: one forward vs two, in process.

With the bfloat16 prefill (the default on CPUs with AMX or AVX512-BF16), prompt rows take bfloat16
GEMMs and decode rows the int8 kernels. One forward over both runs the decoder layer by layer from
Python; two forwards in the same iteration (``ModelRunner._forward_apart``, the engine's default
there) keep the decode rows on the fused C decoder. Both give the same bits; this measures the
throughput: ``c`` clients in a closed loop (a new request the moment one ends, so iterations mix
prompt chunks and decode rows as served traffic does), the same engine switching
``engine.runner.split_mixed`` off and on, round after round, so machine drift hits both alike.

Usage:
    python benchmarks/mixed_iterations.py --config configs/local.yaml --prompts ../shared/datasets/broad/dev.jsonl \\
        --concurrency 4,16 --num-requests 48 --max-tokens 64 --rounds 3 --out benchmarks/results/mixed_iterations
(prints a Markdown table naming the CPU and compute path, writes JSON)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench_loop import closed_loop
from bench_report import write_report

from cluster.config import load_config
from cluster.replica.build import build_engine
from workers.kernels.build import cpu_model
from workers.models.tokenizer import apply_chat_template
from workers.sampling_params import SamplingParams
from workers.training.prompt_sources import first_per_category


def loop_tokens_per_s(engine, ids: list[list[int]], num_requests: int, concurrency: int, mode: str,
                      max_tokens: int, ignore_eos: bool, tag: str) -> float:
    """Output tokens/s of ``num_requests`` requests, ``concurrency`` in flight, each added when one ends
    (:func:`bench_loop.closed_loop`; request ids ``tag``-index)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    return closed_loop(engine, num_requests, concurrency,
                       lambda rid, i, _: engine.add_request(rid, ids[i % len(ids)], params, mode),
                       prefix=f"{tag}-").tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--prompts", required=True, help="JSONL chat prompts ('messages', optional 'category')")
    ap.add_argument("--prompts-per-category", type=int, default=8)
    ap.add_argument("--concurrency", default="4,16", help="comma-separated client counts")
    ap.add_argument("--num-requests", type=int, default=48, help="requests per measurement")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mode", choices=("plain", "spec"), default="plain")
    ap.add_argument("--stop-at-eos", action="store_true", help="end answers at EOS (default: every answer runs "
                    "to --max-tokens, so both ways decode the same tokens)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/mixed_iterations")
    args = ap.parse_args()
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels:
        ap.error(f"--concurrency takes comma-separated integers, got {args.concurrency!r}")
    if min(levels) < 1:
        ap.error(f"--concurrency levels must be >= 1, got {args.concurrency!r}")
    for name in ("num_requests", "rounds", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if max(levels) > args.num_requests:
        ap.error(f"--concurrency {max(levels)} is more than --num-requests {args.num_requests}: "
                 "at most that many would ever be in flight")

    try:  # the prompts first: a bad file fails before the model loads
        rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as err:
        ap.error(f"--prompts {args.prompts}: {err}")
    chats = [r for r in rows if isinstance(r, dict) and isinstance(r.get("messages"), list)]
    if not chats:
        ap.error(f"no chat prompts (rows with a 'messages' list) in {args.prompts}")
    if len(chats) < len(rows):
        print(f"note: {len(rows) - len(chats)} of {len(rows)} rows have no 'messages' list and are left out",
              file=sys.stderr)

    cfg = load_config(args.config)
    # the prefix cache off: a prompt sent again is prefilled again, so every round mixes the same way
    cfg.engine = cfg.engine.model_copy(update={"enable_prefix_caching": False})
    engine = build_engine(cfg)
    if not engine.runner.split_mixed:
        print(f"note: this engine runs mixed iterations as one forward (compute path {engine.compute_path}, prefill "
              f"{engine.prefill_dtype}): both columns measure the same thing here", file=sys.stderr)
    prompts = [p for ps in first_per_category(chats, args.prompts_per_category).values() for p in ps]
    ids = [apply_chat_template(engine.tokenizer, p["messages"]) for p in prompts]
    default = engine.runner.split_mixed
    ignore_eos = not args.stop_at_eos
    for c in levels:  # warm-up, uncounted
        loop_tokens_per_s(engine, ids, min(args.num_requests, 2 * c), c, args.mode, 8, ignore_eos, f"warm{c}")
    runs: dict[str, dict[str, list[float]]] = {}
    try:
        for rnd in range(args.rounds):
            for c in levels:
                for split in (False, True):
                    engine.runner.split_mixed = split
                    tps = loop_tokens_per_s(engine, ids, args.num_requests, c, args.mode, args.max_tokens, ignore_eos,
                                      f"r{rnd}c{c}{split}")
                    runs.setdefault(str(c), {}).setdefault("apart" if split else "joint", []).append(tps)
                    print(f"round {rnd + 1}, {c} concurrent, {'two forwards' if split else 'one forward'}: "
                          f"{tps:.1f} tok/s", flush=True)
    finally:
        engine.runner.split_mixed = default
    head = (f"CPU {cpu_model()}, compute path {engine.compute_path}, prefill {engine.prefill_dtype}; "
            f"{args.num_requests} requests x {args.max_tokens} tokens ({'EOS ends answers' if args.stop_at_eos else 'EOS ignored'}), "
            f"mode {args.mode}, closed loop, median of {args.rounds} alternating rounds")
    if not default:
        head += "; this engine runs mixed iterations as one forward either way: the columns differ by noise only"
    lines = [head, "", "| concurrency | one forward tok/s | two forwards tok/s | two / one |", "|---|---|---|---|"]
    table = {}
    for c, r in runs.items():
        joint, apart = statistics.median(r["joint"]), statistics.median(r["apart"])
        table[c] = {"joint": r["joint"], "apart": r["apart"], "ratio": apart / joint}
        lines.append(f"| {c} | {joint:.1f} | {apart:.1f} | {apart / joint:.2f}x |")
    text = "\n".join(lines)
    print(text)
    write_report(args.out, text, {"command": sys.argv, "cpu": cpu_model(), "compute_path": engine.compute_path,
                                  "prefill_dtype": engine.prefill_dtype, "results": table})


if __name__ == "__main__":
    main()
