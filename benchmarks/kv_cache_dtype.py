"""float16 and int8 KV caches (``engine.kv_cache_dtype``) against float32: perplexity and greedy agreement.

Engines from ``--config`` in one process, identical but for ``kv_cache_dtype`` (float32 and each of
``--kinds``; everything else, prefill and decode paths included, as the config says):

- **perplexity**: teacher-forced, of human-written reference answers given their questions
  (``--reference``, GSM8K-style rows), exp of the mean negative log-likelihood of the answer tokens;
  the answer rows attend over keys and values read back from the cache, so its rounding counts;
- **greedy agreement** with the float32 cache: ``--max-tokens`` greedy tokens per prompt of
  ``--prompts``: the share of prompts whose output is identical, and the mean common prefix.

The speed side is in ``benchmarks/decode_attention.py`` (the kernel) and ``batch_scaling.py`` /
``step_cost_by_context.py`` run on configs that differ in ``kv_cache_dtype``. Prints a Markdown
table naming the CPU and compute path, and writes JSON.

Usage:
    python benchmarks/kv_cache_dtype.py --config configs/local.yaml \\
        --prompts ../shared/datasets/broad/dev.jsonl --num-prompts 32 --max-tokens 64 \\
        --reference ../shared/datasets/gsm8k/gsm8k_dev.jsonl --num-reference 100 \\
        --out benchmarks/results/kv_cache_dtype
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_report import write_report  # noqa: E402
from prefill_precision import answer_perplexity, greedy_agreement, load_references, load_rows  # noqa: E402

from cluster.config import load_config  # noqa: E402
from cluster.replica.build import build_engine  # noqa: E402
from workers.kernels.build import cpu_model  # noqa: E402

KINDS = ("float16", "int8")


def _kinds(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or any(x not in KINDS for x in names):
        raise argparse.ArgumentTypeError(f"kinds are {', '.join(KINDS)} (each against float32); got {text!r}")
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml", help="rdserve config (its kv_cache_dtype is replaced)")
    ap.add_argument("--prompts", required=True, help="JSONL of chat rows (e.g. ../shared/datasets/broad/dev.jsonl)")
    ap.add_argument("--num-prompts", type=_positive, default=32, help="prompts for greedy agreement")
    ap.add_argument("--max-tokens", type=_positive, default=64, help="greedy tokens compared per prompt")
    ap.add_argument("--reference", required=True, help="JSONL of questions with reference answers")
    ap.add_argument("--num-reference", type=_positive, default=100, help="reference rows for perplexity")
    ap.add_argument("--max-context", type=_positive, default=1024, help="skip rows longer than this (tokens)")
    ap.add_argument("--kinds", type=_kinds, default=list(KINDS),
                    help="comma-separated KV cache dtypes compared with float32 (default: float16,int8)")
    ap.add_argument("--out", default="benchmarks/results/kv_cache_dtype", help="OUT.md and OUT.json (no suffix)")
    args = ap.parse_args(argv)
    for path in (args.config, args.prompts, args.reference):
        if not Path(path).is_file():
            ap.error(f"no such file: {path}")

    engines = {}
    for kind in ["float32", *args.kinds]:
        cfg = load_config(args.config)
        cfg.engine.kv_cache_dtype = kind
        engines[kind] = build_engine(cfg)
    path = engines["float32"].compute_path
    refs = load_references(args.reference, args.num_reference)
    result = {"config": args.config, "cpu": cpu_model(), "compute_path": path, "reference": args.reference,
              "perplexity": {kind: answer_perplexity(engine, refs, args.max_context) for kind, engine in engines.items()},
              "agreement": {}}
    rows = load_rows(args.prompts, args.num_prompts)
    for kind in args.kinds:
        result["agreement"][kind] = greedy_agreement(engines["float32"], engines[kind], rows, args.max_tokens)
    lines = [f"KV cache dtype, {result['cpu']}, compute path {path}; greedy agreement with float32 over "
             f"{args.max_tokens} tokens", "",
             "| KV cache | answer perplexity | tokens | greedy output identical | mean common prefix |",
             "|---|---|---|---|---|"]
    for kind, v in result["perplexity"].items():
        a = result["agreement"].get(kind)
        same = f"{a['identical']} of {a['prompts']}" if a else "-"
        prefix = f"{a['mean_common_prefix']:.1f}" if a else "-"
        lines.append(f"| {kind} | {v['perplexity']:.4f} | {v['tokens']} | {same} | {prefix} |")
    text = "\n".join(lines)
    print(text)
    write_report(args.out, text, result)


if __name__ == "__main__":
    main()
