r"""Per-request draft trees cut by the drafter's confidence (``speculation.auto.prune_trees``) against
whole trees, under the live ``auto`` policy, in process, at one batch size.

Three engines in one process: plain decoding (``speculation.policy: off``), ``auto`` with pruning
(the config's policy, ``prune_trees: true``) and ``auto`` without it. Prompts run in groups of
``--batch-size``: a group's requests are added together and the engine steps until all finish
(closed groups, so every engine decodes the same batches), and the order of the three engines
alternates from group to group, so the VM's drift falls on all alike. Prefix caching is off.
Greedy: the engines must give the same tokens, and the script stops if they do not. Tokens/s =
completion tokens / wall time, prefill included. Also printed: tokens per decode step (each
request's first token, made by its prompt's step, left out), and tree rows verified per drafted
request-step (the root counts).

Usage:
    python benchmarks/tree_pruning.py --config configs/local.yaml --prompts ../shared/datasets/broad/dev.jsonl \
        --prompts-per-category 4 --max-tokens 128 --batch-size 1 --out benchmarks/results/tree_pruning_b1
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from bench_prompts import chat_rows_or_exit, positive
from bench_report import write_report
from bench_spec import fixed_speculation
from pydantic import ValidationError
from tqdm import tqdm

from cluster.config import load_config
from cluster.config.base import ConfigError
from cluster.replica.build import build_engine
from workers.kernels.build import cpu_model
from workers.sampling_params import SamplingParams
from workers.training.prompt_sources import first_per_category

MODES = ("plain", "pruned", "whole")



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(Path(__file__).resolve().parent.parent / "configs/local.yaml"),
                    help="rdserve config (policy auto); default: the repository's configs/local.yaml")
    ap.add_argument("--prompts", required=True, help="JSONL prompts with 'messages' and 'category'")
    ap.add_argument("--prompts-per-category", type=positive, default=4, help="the first N of each category")
    ap.add_argument("--max-tokens", type=positive, default=128, help="completion tokens per request (at most)")
    ap.add_argument("--batch-size", type=positive, default=1, help="requests decoded together")
    ap.add_argument("--rounds", type=positive, default=1, help="times every group runs on each engine")
    ap.add_argument("--out", default="benchmarks/results/tree_pruning", help="output path without suffix")
    args = ap.parse_args()
    rows = chat_rows_or_exit(ap, args.prompts)
    prompts = [p for ps in first_per_category(rows, args.prompts_per_category).values() for p in ps]
    try:
        cfg = load_config(args.config)
        if cfg.speculation.policy != "auto":
            ap.error(f"--config {args.config}: speculation.policy is {cfg.speculation.policy!r}; this compares auto's trees")
        auto = cfg.speculation.auto
        pruned_spec = cfg.speculation.model_copy(update={"auto": auto.model_copy(update={"prune_trees": True})})
        whole_spec = cfg.speculation.model_copy(update={"auto": auto.model_copy(update={"prune_trees": False})})
        off_spec = fixed_speculation(cfg.speculation, policy="off")
    except (ConfigError, ValidationError) as err:
        ap.error(str(err))
    cfg.engine = cfg.engine.model_copy(update={"enable_prefix_caching": False})
    engines = {"plain": build_engine(cfg.model_copy(update={"speculation": off_spec})),
               "pruned": build_engine(cfg.model_copy(update={"speculation": pruned_spec})),
               "whole": build_engine(cfg.model_copy(update={"speculation": whole_spec}))}
    mode_of = {"plain": "plain", "pruned": "spec", "whole": "spec"}
    seconds, tokens, steps = Counter(), Counter(), Counter()
    rows_verified, drafted = Counter(), Counter()
    for name in ("pruned", "whole"):  # tree rows per drafted request-step, from the runner's results
        eng = engines[name]
        observe = eng.spec_policy.observe

        def count(state, shape, was_drafted, accepted, nrows=None, _name=name, _observe=observe):
            if was_drafted and nrows is not None:
                rows_verified[_name] += nrows
                drafted[_name] += 1
            return _observe(state, shape, was_drafted, accepted, nrows)

        eng.spec_policy.observe = count
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    groups = [prompts[i:i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    groups[-1] += prompts[: args.batch_size - len(groups[-1])]  # the last group filled with the first prompts
    if len(groups[-1]) < args.batch_size:
        ap.error(f"--batch-size {args.batch_size}: only {len(prompts)} prompts selected; lower it or raise "
                 "--prompts-per-category")
    requests = len(groups) * args.batch_size * args.rounds

    def run(name: str, group: list[dict], tag: str) -> dict[str, list[int]]:
        eng = engines[name]
        ids = [eng.encode_chat(p["messages"]) for p in group]
        out = {f"{tag}-{k}": [] for k in range(len(group))}
        t0 = time.perf_counter()
        for k, prompt in enumerate(ids):
            eng.add_request(f"{tag}-{k}", prompt, params, mode_of[name])
        done = 0
        while done < len(group):
            for d in eng.step():
                out[d.request_id] += d.token_ids
                if d.finished:
                    done += 1
                    tokens[name] += d.completion_tokens
                    steps[name] += d.num_steps
        seconds[name] += time.perf_counter() - t0
        return out

    for name in MODES:  # warm-up: one short group each
        for _ in engines[name].generate(engines[name].encode_chat(prompts[0]["messages"]),
                                        SamplingParams(max_tokens=16, temperature=0.0), mode_of[name]):
            pass
    n = 0
    for r in range(args.rounds):
        for g, group in enumerate(tqdm(groups, desc=f"groups (round {r + 1})")):
            order = MODES if n % 2 == 0 else MODES[::-1]
            n += 1
            outputs = {name: run(name, group, f"r{r}g{g}") for name in order}
            if len({json.dumps(o, sort_keys=True) for o in outputs.values()}) != 1:
                raise SystemExit(f"group {g}: greedy outputs differ between engines")
    rate = {m: tokens[m] / seconds[m] for m in MODES}
    # tokens per decode step: each request's first token comes from its prompt's step, not a decode step
    per_step = {m: (tokens[m] - requests) / max(steps[m], 1) for m in MODES}
    rows_per = {m: rows_verified[m] / drafted[m] if drafted[m] else None for m in ("pruned", "whole")}
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    table = "\n".join([
        f"{cpu_model()}, compute path {engines['pruned'].compute_path}; auto: {engines['pruned'].spec_selection.source}; "
        f"{len(groups)} groups of {args.batch_size} x <= {args.max_tokens} tokens, {args.rounds} round(s), engines interleaved",
        "",
        "| engine | tok/s | vs plain | tokens per step | tree rows per drafted step |",
        "|---|---|---|---|---|",
        *[f"| {m} | {rate[m]:.1f} | {rate[m] / rate['plain']:.3f}x | {per_step[m]:.2f} | "
          f"{fmt(rows_per.get(m))} |" for m in MODES],
        "",
        f"pruned / whole: **{rate['pruned'] / rate['whole']:.3f}x**",
    ])
    print(table)
    write_report(args.out, table, {"tokens_per_s": rate, "seconds": dict(seconds), "tokens": dict(tokens),
                                   "tokens_per_step": per_step, "rows_per_drafted_step": rows_per,
                                   "args": vars(args), "cpu": cpu_model(),
                                   "compute_path": engines["pruned"].compute_path,
                                   "step_conditions": engines["pruned"].step_conditions})


if __name__ == "__main__":
    main()
