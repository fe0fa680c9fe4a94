"""Int8 activations (``engine.decode_activations``) against float32: perplexity and greedy agreement.

Two engines from ``--config`` in one process, ``decode_activations`` float32 and int8, both with
``prefill_dtype: float32`` so that every row (prompt rows too) takes the path under test:

- **perplexity**: teacher-forced, of human-written reference answers given their questions
  (``--reference``, GSM8K-style rows), exp of the mean negative log-likelihood of the answer tokens;
- **greedy agreement**: ``--max-tokens`` greedy tokens per prompt of ``--prompts``: the share of
  prompts whose output is identical, and the mean common prefix.

Prints a Markdown table and writes JSON.

Usage:
    python benchmarks/decode_activations.py --config configs/local.yaml \
        --prompts ../shared/datasets/broad/dev.jsonl --num-prompts 32 --max-tokens 64 \
        --reference ../shared/datasets/gsm8k/gsm8k_dev.jsonl --num-reference 100 \
        --out benchmarks/results/decode_activations
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefill_precision import answer_perplexity, greedy_agreement, load_references, load_rows  # noqa: E402

from cluster.config import load_config  # noqa: E402
from cluster.replica.build import build_engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--prompts", required=True, help="JSONL of chat rows (e.g. ../shared/datasets/broad/dev.jsonl)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reference", required=True, help="JSONL of questions with reference answers")
    ap.add_argument("--num-reference", type=int, default=100)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--out", default="benchmarks/results/decode_activations")
    args = ap.parse_args()

    engines = {}
    for kind in ("float32", "int8"):
        cfg = load_config(args.config)
        cfg.engine.prefill_dtype, cfg.engine.decode_activations = "float32", kind
        engines[kind] = build_engine(cfg)
        assert engines[kind].decode_activations == kind
    refs = load_references(args.reference, args.num_reference)
    result = {"config": args.config, "reference": args.reference,
              "perplexity": {kind: answer_perplexity(engine, refs, args.max_context) for kind, engine in engines.items()},
              "agreement": greedy_agreement(engines["float32"], engines["int8"],
                                            load_rows(args.prompts, args.num_prompts), args.max_tokens)}
    agreement = result["agreement"]
    print("| decode activations | answer perplexity | tokens |\n|---|---|---|")
    for kind, v in result["perplexity"].items():
        print(f"| {kind} | {v['perplexity']:.4f} | {v['tokens']} |")
    print(f"\ngreedy output identical on {agreement['identical']} of {agreement['prompts']} prompts over "
          f"{args.max_tokens} tokens; mean common prefix {agreement['mean_common_prefix']:.1f} tokens")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
