r"""In process: plain decoding, the live ``auto`` policy and one fixed draft-tree shape, interleaved,
each mode on an engine of its own; at batch 1 (default) or ``--concurrency N`` requests in flight.

``benchmarks/spec_vs_plain.py --policy auto`` runs plain and auto requests on one engine, so the
live policy also sees forced-plain requests between its own (a replica serving mixed modes); this
script gives ``auto`` an engine of its own, as a replica serving only ``auto`` traffic has, plain
decoding another (``speculation.policy: off``), and times a fixed shape (``--num-beams`` x
``--draft-len-per-beam`` plus the config's prompt-lookup beam) on a third, all in one process. The order of the three modes alternates from prompt to
prompt, so the VM's drift falls on all three alike. Prefix caching is off (a cached prompt would
skip the next mode's prefill). Greedy: the three must give the same tokens, and the script stops if
they do not. Tokens/s = completion tokens / wall time, prefill included.

With ``--concurrency N`` each mode runs the prompts in groups of ``4 N``, keeping ``N`` requests in
flight (a new one joins as one finishes, as a closed-loop client does), the modes' order alternating
from group to group. Batched greedy output may differ from batch 1 where float sums meet a near tie,
so differing outputs are counted and reported, not fatal. ``auto``'s iterations are reported by shape
for each number of generation requests.

The issue-35 targets read off it: ``auto`` vs plain (>= 1.8x with AMX, >= 1.3x on AVX2 only) and
``auto`` vs the better forced mode (>= 0.95x).

Usage:
    python benchmarks/auto_vs_fixed.py --config configs/local.yaml --prompts ../shared/datasets/broad/dev.jsonl \
        --prompts-per-category 6 --max-tokens 192 --num-beams 1 --draft-len-per-beam 1 \
        --out benchmarks/results/auto_vs_fixed
    python benchmarks/auto_vs_fixed.py --prompts ../shared/datasets/broad/dev.jsonl --prompts-per-category 4 \
        --max-tokens 64 --concurrency 8 --out benchmarks/results/auto_vs_fixed_c8
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

from tqdm import tqdm

from bench_loop import closed_loop
from bench_prompts import chat_rows_or_exit, positive
from bench_report import write_report
from bench_spec import fixed_speculation

from pydantic import ValidationError

from cluster.config import load_config
from cluster.config.base import ConfigError
from cluster.replica.build import build_engine
from workers.kernels.build import cpu_model
from workers.sampling_params import SamplingParams
from workers.training.prompt_sources import first_per_category

MODES = ("plain", "auto", "fixed")



def count_shapes(engine, by_batch: Counter | None = None) -> Counter:
    """Count the draft-tree shape (``BxD``, or ``plain``) of each of ``engine``'s iterations that decode,
    as its speculation policy is told of them (``observe_step``); returns the live counter.
    ``by_batch``: also counts ``(generation requests, shape)`` there."""
    counts: Counter = Counter()
    policy = engine.spec_policy
    observe_step = policy.observe_step

    def counted(shape, num_generation, *rest, **kw):
        if num_generation:
            counts[str(shape) if shape is not None else "plain"] += 1
            if by_batch is not None:
                by_batch[num_generation, str(shape) if shape is not None else "plain"] += 1
        return observe_step(shape, num_generation, *rest, **kw)

    policy.observe_step = counted
    return counts


def run_closed_loop(engine, mode: str, prompts: list[list[int]], params: SamplingParams,
                    concurrency: int) -> tuple[list[list[int]], int]:
    """Decode ``prompts`` on ``engine`` with ``concurrency`` requests in flight (:func:`bench_loop.closed_loop`).
    Returns each prompt's output tokens and the completion tokens in all."""
    run = closed_loop(engine, len(prompts), concurrency,
                      lambda rid, i, _: engine.add_request(rid, prompts[i], params, mode))
    return run.outputs, run.completion_tokens


def batch_shape_text(by_batch: Counter) -> str:
    """``auto``'s iterations by shape for each number of generation requests, one line per count."""
    lines = []
    for b in sorted({b for b, _ in by_batch}):
        row = {shape: n for (bb, shape), n in by_batch.items() if bb == b}
        total = sum(row.values())
        lines.append(f"  b={b}: {total} iterations: "
                     + ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(row.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml", help="rdserve config (its speculation policy is auto's)")
    ap.add_argument("--prompts", required=True, help="JSONL prompts with 'messages' and 'category'")
    ap.add_argument("--prompts-per-category", type=positive, default=6, help="the first N of each category")
    ap.add_argument("--max-tokens", type=positive, default=192, help="completion tokens per request (at most)")
    ap.add_argument("--num-beams", type=positive, default=1, help="the fixed shape's beams")
    ap.add_argument("--draft-len-per-beam", type=positive, default=1, help="the fixed shape's draft tokens per beam")
    ap.add_argument("--concurrency", type=positive, default=1,
                    help="requests in flight per mode (1: one prompt at a time, modes interleaved per prompt; N > 1: "
                         "groups of 4N prompts, modes alternating per group, differing greedy outputs counted)")
    ap.add_argument("--out", default="benchmarks/results/auto_vs_fixed", help="output path without suffix")
    args = ap.parse_args()
    rows = chat_rows_or_exit(ap, args.prompts)
    prompts = [p for ps in first_per_category(rows, args.prompts_per_category).values() for p in ps]

    try:
        cfg = load_config(args.config)
        fixed_spec = fixed_speculation(cfg.speculation, num_beams=args.num_beams,
                                       draft_len_per_beam=args.draft_len_per_beam)
        off_spec = fixed_speculation(cfg.speculation, policy="off")
    except (ConfigError, ValidationError) as err:
        ap.error(str(err))
    cfg.engine = cfg.engine.model_copy(update={"enable_prefix_caching": False})
    auto = build_engine(cfg)
    fixed = build_engine(cfg.model_copy(update={"speculation": fixed_spec}))
    plain = build_engine(cfg.model_copy(update={"speculation": off_spec}))
    engines = {"plain": (plain, "plain"), "auto": (auto, "spec"), "fixed": (fixed, "spec")}
    seconds, tokens = Counter(), Counter()
    by_batch: Counter = Counter()
    auto_shapes = count_shapes(auto, by_batch)

    def run(mode: str, ids: list[int]) -> list[int]:
        engine, engine_mode = engines[mode]
        t0, out, last = time.perf_counter(), [], None
        for last in engine.generate(ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), engine_mode):
            out += last.token_ids
        seconds[mode] += time.perf_counter() - t0
        tokens[mode] += last.completion_tokens
        return out

    warm = auto.encode_chat(prompts[0]["messages"])
    for engine, mode in engines.values():
        for _ in engine.generate(warm, SamplingParams(max_tokens=16, temperature=0.0), mode):
            pass
    mismatches = 0
    if args.concurrency == 1:
        for i, p in enumerate(tqdm(prompts, desc="prompts")):
            ids = auto.encode_chat(p["messages"])
            order = MODES if i % 2 == 0 else MODES[::-1]
            outputs = {mode: run(mode, ids) for mode in order}
            if len({tuple(o) for o in outputs.values()}) != 1:
                raise SystemExit(f"prompt {i}: greedy outputs differ between modes: {outputs}")
    else:
        group = 4 * args.concurrency
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        all_ids = [auto.encode_chat(p["messages"]) for p in prompts]
        for g, start in enumerate(tqdm(range(0, len(all_ids), group), desc=f"groups of {group}")):
            ids = all_ids[start:start + group]
            outputs = {}
            for mode in (MODES if g % 2 == 0 else MODES[::-1]):
                engine, engine_mode = engines[mode]
                t0 = time.perf_counter()
                outputs[mode], n = run_closed_loop(engine, engine_mode, ids, params, args.concurrency)
                seconds[mode] += time.perf_counter() - t0
                tokens[mode] += n
            mismatches += sum(len({tuple(outputs[m][i]) for m in MODES}) != 1 for i in range(len(ids)))
    rate = {m: tokens[m] / seconds[m] for m in MODES}
    steps = sum(auto_shapes.values())
    chosen = ", ".join(f"{k} {v / steps:.0%}" for k, v in auto_shapes.most_common()) if steps else "-"
    shape = f"{args.num_beams}x{args.draft_len_per_beam}"
    table = "\n".join([
        f"{cpu_model()}, compute path {auto.compute_path}; auto: {auto.spec_selection.source}; fixed {shape} "
        f"+ {cfg.speculation.prompt_lookup_num_tokens}-token lookup beam; {len(prompts)} prompts x <= {args.max_tokens} "
        f"tokens, {'batch 1' if args.concurrency == 1 else f'up to {min(args.concurrency, len(prompts))} in flight'}, "
        "modes interleaved",
        "",
        f"| plain tok/s | auto tok/s | fixed {shape} tok/s | auto / plain | fixed / plain | auto / better forced |",
        "|---|---|---|---|---|---|",
        f"| {rate['plain']:.1f} | {rate['auto']:.1f} | {rate['fixed']:.1f} | {rate['auto'] / rate['plain']:.3f}x | "
        f"{rate['fixed'] / rate['plain']:.3f}x | {rate['auto'] / max(rate['plain'], rate['fixed']):.3f}x |",
        "",
        f"auto's decode iterations by shape (warm-up included): {chosen}",
        *([f"prompts whose greedy output differed between modes (batched float sums): {mismatches} of {len(prompts)}",
           "auto's iterations by generation requests (warm-up included):", batch_shape_text(by_batch)] if args.concurrency > 1 else []),
    ])
    print(table)
    write_report(args.out, table, {"tokens_per_s": rate, "seconds": dict(seconds), "tokens": dict(tokens),
                                   "args": vars(args), "cpu": cpu_model(), "compute_path": auto.compute_path,
                                   "auto_policy": auto.spec_selection.source,
                                   "auto_measured_at_start": auto.spec_selection.measure_at_start,
                                   "step_conditions": auto.step_conditions, "auto_shapes": dict(auto_shapes),
                                   "auto_shapes_by_batch": {f"{b}:{k}": v for (b, k), v in by_batch.items()},
                                   "greedy_mismatches": mismatches})


if __name__ == "__main__":
    main()
