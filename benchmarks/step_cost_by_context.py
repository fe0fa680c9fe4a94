r"""Step time by context length, plain vs a draft tree, at batch 1.

The goodput model (``workers/speculation/goodput.py``) prices a step by batch size and tree shape
only, from ``rdserve calibrate`` (short prompts) and live samples. This measures how both costs grow
with the tokens already in the request's KV cache: one request of ``L`` prompt tokens (the broad
prompts' text run together, no chat template), decoded ``--max-tokens`` tokens with ``ignore_eos``,
plain and then drafting a tree of the config's ``num_beams x draft_len_per_beam`` (plus its
prompt-lookup beam) every step (the config's speculation policy is replaced by that fixed shape, so
no step takes another shape); the median seconds of its generation-only iterations (the first
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
from bench_spec import fixed_speculation
from bench_report import write_report

from cluster.config import load_config
from cluster.replica.build import build_engine
from workers.sampling_params import SamplingParams
from workers.kernels.build import cpu_model


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers expected, got {text!r}") from None
    if any(n < 1 for n in lengths):
        raise argparse.ArgumentTypeError(f"context lengths must be >= 1, got {text!r}")
    return lengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml", help="rdserve config (its speculation shape is forced)")
    ap.add_argument("--prompts", default=str(DATASETS / "broad/dev.jsonl"),
                    help="chat JSONL whose last messages, run together, make the context")
    ap.add_argument("--context-lengths", type=_lengths, default="32,128,512,1024",
                    help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens decoded per run (ignore_eos)")
    ap.add_argument("--skip", type=int, default=5, help="first generation iterations of a run not counted")
    ap.add_argument("--rounds", type=int, default=2, help="measurements per length and mode; medians reported")
    ap.add_argument("--out", default="benchmarks/results/step_cost_by_context", help="output path without suffix")
    args = ap.parse_args()
    lengths = args.context_lengths
    if args.skip < 0:
        ap.error(f"--skip must be >= 0, got {args.skip}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.max_tokens <= args.skip + 1:
        ap.error(f"--max-tokens must exceed --skip + 1 ({args.skip + 1}), got {args.max_tokens}")
    try:
        rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        text = " ".join(r["messages"][-1]["content"] for r in rows)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        ap.error(f"--prompts {args.prompts}: chat JSONL rows with 'messages' expected ({type(err).__name__}: {err})")
    try:
        cfg = load_config(args.config)
    except Exception as err:  # ConfigError, a missing file: named in the message
        ap.error(f"--config {args.config}: {err}")
    if not cfg.drafter.path:
        ap.error(f"--config {args.config} has no drafter (drafter.path): there is no tree to time")
    cfg.engine = cfg.engine.model_copy(update={"enable_prefix_caching": False})
    cfg.speculation = fixed_speculation(cfg.speculation)  # every tree step of the config's shape (a live
    # policy would pick its own shapes)
    if max(lengths) + args.max_tokens > cfg.engine.max_seq_len:
        ap.error(f"the longest context plus --max-tokens ({max(lengths) + args.max_tokens}) exceeds "
                 f"engine.max_seq_len ({cfg.engine.max_seq_len})")
    engine = build_engine(cfg)
    shape = engine.forced_shape
    if not engine.speculative_available or shape is None:
        ap.error("the config's speculation gives no shape to draft (speculation.policy off?)")
    ids = engine.encode_prompt(text)
    if len(ids) < max(lengths) + 1:
        ap.error(f"the prompts give {len(ids)} tokens, fewer than --context-lengths asks for")
    times: list[float] = []
    observe = engine.spec_policy.observe_step  # once per generation-only iteration, with its seconds

    def timed(step_shape, num_generation, num_full_trees, num_plain, seconds, *context):
        if num_plain == num_generation or (step_shape == shape and num_full_trees == num_generation):
            times.append(seconds)  # all plain, or a whole tree of the shape (not one cut short at the end)
        return observe(step_shape, num_generation, num_full_trees, num_plain, seconds, *context)

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
                if len(times) <= args.skip:
                    ap.error(f"context {n}, {mode}: only {len(times)} generation steps of {args.max_tokens} "
                             f"tokens; raise --max-tokens (trees emit several tokens per step)")
                runs[n][mode].append(statistics.median(times[args.skip:]))
            print(f"round {rnd + 1} context {n}: plain {1e3 * runs[n]['plain'][-1]:.2f} ms, "
                  f"tree {1e3 * runs[n]['tree'][-1]:.2f} ms", flush=True)
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
