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
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefill_precision import greedy, load_references, load_rows, response_nll  # noqa: E402

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
    result = {"config": args.config, "reference": args.reference, "perplexity": {}, "agreement": {}}
    for kind, engine in engines.items():
        nll = n = 0
        for messages, answer in refs:
            p = engine.encode_chat(messages)
            r = engine.encode_prompt(answer)
            if len(p) + len(r) > args.max_context:
                continue
            a, b = response_nll(engine, p, r)
            nll, n = nll + a, n + b
        result["perplexity"][kind] = {"tokens": n, "perplexity": math.exp(nll / n)}
    same = prefix = 0
    rows = load_rows(args.prompts, args.num_prompts)
    for row in rows:
        ids = engines["float32"].encode_chat(row["messages"])
        a, b = (greedy(engines[k], ids, args.max_tokens) for k in ("float32", "int8"))
        same += a == b
        prefix += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    result["agreement"] = {"prompts": len(rows), "identical": same, "mean_common_prefix": prefix / len(rows)}
    print("| decode activations | answer perplexity | tokens |\n|---|---|---|")
    for kind, v in result["perplexity"].items():
        print(f"| {kind} | {v['perplexity']:.4f} | {v['tokens']} |")
    print(f"\ngreedy output identical on {same} of {len(rows)} prompts over {args.max_tokens} tokens; "
          f"mean common prefix {prefix / len(rows):.1f} tokens")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
