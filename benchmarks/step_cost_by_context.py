"""Step time by context length, plain vs a draft tree, at batch 1.

The goodput model (``workers/speculation/goodput.py``) prices a step by batch size and tree shape
only, from ``rdserve calibrate`` (short prompts) and live samples. This measures how both costs grow
with the tokens already in the request's KV cache: one request of ``L`` prompt tokens (the broad
prompts' text run together, no chat template), decoded ``--max-tokens`` tokens with ``ignore_eos``,
plain and then forcing a draft tree of the config's ``num_beams x draft_len_per_beam`` (plus its
prompt-lookup beam) every step; the median seconds of its generation-only iterations (the first
``--skip`` dropped) for each ``L``, ``--rounds`` times. Prefix caching is off (the spec run would
find the plain run's prompt cached). Prints a Markdown table naming the CPU and compute path, and
writes JSON.

Usage:
    python benchmarks/step_cost_by_context.py --config configs/local.yaml \
        --prompts ../shared/datasets/broad/dev.jsonl --context-lengths 32,128,512,1024 \
        --out benchmarks/results/step_cost_by_context
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench_prompts import DATASETS
from bench_report import write_report

from cluster.config import load_config
from cluster.replica.build import build_engine
from workers.sampling_params import SamplingParams
from workers.kernels.build import cpu_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml", help="rdserve config (its speculation shape is forced)")
    ap.add_argument("--prompts", default=str(DATASETS / "broad/dev.jsonl"),
                    help="chat JSONL whose last messages, run together, make the context")
    ap.add_argument("--context-lengths", default="32,128,512,1024", help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens decoded per run (ignore_eos)")
    ap.add_argument("--skip", type=int, default=5, help="first generation iterations of a run not counted")
    ap.add_argument("--rounds", type=int, default=2, help="measurements per length and mode; medians reported")
    ap.add_argument("--out", default="benchmarks/results/step_cost_by_context", help="output path without suffix")
    args = ap.parse_args()
    lengths = [int(x) for x in args.context_lengths.split(",")]
    if any(n < 1 for n in lengths) or args.max_tokens <= args.skip + 1 or args.rounds < 1:
        ap.error("context lengths must be >= 1, --max-tokens > --skip + 1, --rounds >= 1")

    cfg = load_config(args.config)
    cfg.engine = cfg.engine.model_copy(update={"enable_prefix_caching": False})
    engine = build_engine(cfg)
    if engine.forced_shape is None:
        ap.error("the config has no drafter or no speculation shape to force")
    text = " ".join(json.loads(line)["messages"][-1]["content"]
                    for line in Path(args.prompts).read_text().splitlines() if line.strip())
    ids = engine.encode_prompt(text)
    if len(ids) < max(lengths) + 1:
        ap.error(f"the prompts give {len(ids)} tokens, fewer than --context-lengths asks for")
    times: list[float] = []
    observe = engine.spec_policy.observe_step  # once per generation-only iteration, with its seconds

    def timed(shape, num_generation, num_full_trees, num_plain, seconds):
        times.append(seconds)
        return observe(shape, num_generation, num_full_trees, num_plain, seconds)

    engine.spec_policy.observe_step = timed
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for _ in engine.generate(ids[:16], SamplingParams(max_tokens=8, temperature=0.0), "spec", force_draft=True):
        pass  # warm-up
    runs: dict = {n: {"plain": [], "tree": []} for n in lengths}
    for rnd in range(args.rounds):
        for n in lengths:
            for mode, force in (("plain", False), ("tree", True)):
                times.clear()
                for _ in engine.generate(ids[:n], params, "plain" if mode == "plain" else "spec", force_draft=force):
                    pass
                runs[n][mode].append(statistics.median(times[args.skip:]))
            print(f"round {rnd + 1} context {n}: plain {1e3 * runs[n]['plain'][-1]:.2f} ms, "
                  f"tree {1e3 * runs[n]['tree'][-1]:.2f} ms", flush=True)
    shape = engine.forced_shape
    lines = [f"{cpu_model()}, compute path {engine.compute_path}; batch 1, tree {shape[0]}x{shape[1]} "
             f"+ prompt lookup {cfg.speculation.prompt_lookup_num_tokens} tokens, {args.max_tokens} tokens "
             f"per run (first {args.skip} iterations not counted), median of {args.rounds} rounds", "",
             "| context tokens | plain step ms | tree step ms | tree / plain |", "|---|---|---|---|"]
    results = {}
    for n in lengths:
        p, t = statistics.median(runs[n]["plain"]), statistics.median(runs[n]["tree"])
        results[n] = {"plain_step_s": p, "tree_step_s": t, "runs": runs[n]}
        lines.append(f"| {n} | {1e3 * p:.2f} | {1e3 * t:.2f} | {t / p:.2f}x |")
    table = "\n".join(lines)
    print(table)
    write_report(args.out, table, {"args": vars(args), "compute_path": engine.compute_path, "cpu": cpu_model(),
                                   "shape": list(shape), "results": results})
    engine.close()


if __name__ == "__main__":
    main()
