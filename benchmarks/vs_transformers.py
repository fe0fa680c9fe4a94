"""Plain decoding: rdserve's engine against transformers' ``generate()`` at batch 1 and 16.

Same model directory, dtype, threads and prompts (held-out chat/code/math prompts, chat template);
greedy, exactly ``--max-tokens`` new tokens per request (EOS ignored; transformers:
``min_new_tokens``), left-padded batches for transformers, in-flight batching for rdserve (all
requests submitted at once). Reported: output tokens/s over wall time including prefill, median of
``--runs``.

Usage:
    python benchmarks/vs_transformers.py --config configs/local.yaml --batch-sizes 1,16 \
        --max-tokens 64 --runs 3 --out benchmarks/results/vs_transformers
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batch_scaling import run_batch  # benchmarks/ is on sys.path when run as a script
from bench_prompts import DATASETS
from bench_report import write_report
from cluster.config import load_config
from cluster.replica.build import build_engine
from workers.models.pull import pull_default
from workers.training.prompt_sources import build_prompts, require_datasets


def ours(engine, prompts: list[list[int]], max_tokens: int) -> float:
    """rdserve plain decoding, all requests submitted at once (``batch_scaling.run_batch``)."""
    result = run_batch(engine, prompts, max_tokens, "plain")
    assert result["output_tokens"] == max_tokens * len(prompts)
    return result["tokens_per_s"]


def theirs(model, tokenizer, prompts: list[list[int]], max_tokens: int) -> float:
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                         do_sample=False, pad_token_id=pad)
    dt = time.perf_counter() - t0
    assert out.shape[1] - width == max_tokens
    return max_tokens * len(prompts) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--datasets-dir", default=str(DATASETS))
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", help="override engine.dtype (both sides use it)")
    ap.add_argument("--out", default="benchmarks/results/vs_transformers")
    args = ap.parse_args()

    batches = [int(b) for b in args.batch_sizes.split(",")]
    cfg = load_config(args.config)
    update = {"max_batch_size": max(batches)}
    if args.dtype:
        update["dtype"] = args.dtype
    cfg.engine = cfg.engine.model_copy(update=update)
    model_dir = cfg.model.path or pull_default()
    cfg.model = cfg.model.model_copy(update={"path": model_dir})
    engine = build_engine(cfg)
    threads = torch.get_num_threads()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.engine.dtype]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    prompts = [engine.encode_chat(p["messages"]) for p in build_prompts(require_datasets(Path(args.datasets_dir)), "heldout")]
    prompts = [p for p in prompts if len(p) <= 256]
    ours(engine, prompts[:1], 4)
    with torch.inference_mode():
        theirs(hf, tokenizer, prompts[:1], 4)
    rows = []
    for b in batches:
        chosen = [prompts[i % len(prompts)] for i in range(b)]
        a = statistics.median(ours(engine, chosen, args.max_tokens) for _ in range(args.runs))
        with torch.inference_mode():
            t = statistics.median(theirs(hf, tokenizer, chosen, args.max_tokens) for _ in range(args.runs))
        rows.append({"batch_size": b, "rdserve_tokens_per_s": a, "transformers_tokens_per_s": t, "ratio": a / t})
        print(f"batch {b}: rdserve {a:.1f} tok/s, transformers {t:.1f} tok/s ({a / t:.2f}x)", flush=True)
    lines = [
        f"plain greedy decoding, dtype {cfg.engine.dtype}, threads {threads}, {args.max_tokens} new tokens per "
        f"request (EOS ignored), median of {args.runs} runs, wall time including prefill",
        "",
        "| batch | rdserve tokens/s | transformers generate() tokens/s | rdserve / transformers |",
        "|---|---|---|---|",
    ] + [f"| {r['batch_size']} | {r['rdserve_tokens_per_s']:.1f} | {r['transformers_tokens_per_s']:.1f} | "
         f"{r['ratio']:.2f}x |" for r in rows]
    table = "\n".join(lines)
    print(table)
    write_report(args.out, table, {"dtype": cfg.engine.dtype, "threads": threads, "max_tokens": args.max_tokens,
                                   "rows": rows})


if __name__ == "__main__":
    main()
