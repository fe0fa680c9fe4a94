"""Prefill in bfloat16 (``engine.prefill_dtype``) against float32: time to first token, greedy
agreement and perplexity, on the same engine config.

Two engines from ``--config`` in one process, one with ``prefill_dtype: float32`` and one with
``bfloat16`` (same GGUF blocks, same kernels for decode steps), on the first ``--num-prompts`` chat
rows of ``--prompts`` (a JSONL of ``{"messages": [...]}`` rows; rows with an assistant message also
give a reference response):

- **TTFT**: ``max_tokens`` 1, in process, median over prompts and ``--repeats``, interleaved;
- **greedy agreement**: ``--max-tokens`` greedy tokens with each engine: the share of prompts whose
  output is identical, and the mean length of the common prefix;
- **perplexity**: teacher-forced, of human-written reference answers given their questions
  (``--reference``: GSM8K-style ``{"question", "answer"}`` rows, or chat rows ending with an
  assistant message; prompt + answer prefilled as one chunk, so every row takes the engine's prefill
  path): exp of the mean negative log-likelihood of the answer tokens.

Prints a Markdown table and writes JSON.

Usage:
    python benchmarks/prefill_precision.py --config configs/local.yaml \
        --prompts ../shared/datasets/broad/dev.jsonl --num-prompts 48 --max-tokens 64 \
        --reference ../shared/datasets/gsm8k/gsm8k_dev.jsonl --num-reference 100 \
        --out benchmarks/results/prefill_precision
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from bench_report import write_report
from tqdm import tqdm

from cluster.config import load_config
from cluster.replica.build import build_engine
from workers.forward_batch import contiguous_batch
from workers.sampling_params import SamplingParams


def load_rows(path: str, n: int) -> list[dict]:
    rows = []
    for line in Path(path).read_text(encoding="utf-8").split("\n"):
        if line.strip():
            row = json.loads(line)
            if row.get("messages"):
                rows.append(row)
        if len(rows) == n:
            break
    return rows


def load_references(path: str, n: int) -> list[tuple[list[dict], str]]:
    """(chat messages, answer) pairs from GSM8K-style or chat rows."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").split("\n"):
        if not line.strip():
            continue
        row = json.loads(line)
        if "question" in row and "answer" in row:
            out.append(([{"role": "user", "content": row["question"]}], row["answer"]))
        elif row.get("messages") and row["messages"][-1]["role"] == "assistant":
            out.append((row["messages"][:-1], row["messages"][-1]["content"]))
        if len(out) == n:
            break
    return out


def ttft_ms(engine, prompt_ids: list[int]) -> float:
    t = time.perf_counter()
    for _ in engine.generate(prompt_ids, SamplingParams(max_tokens=1, temperature=0.0), "plain"):
        pass
    return 1000 * (time.perf_counter() - t)


def greedy(engine, prompt_ids: list[int], max_tokens: int) -> list[int]:
    return [t for d in engine.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), "plain")
            for t in d.token_ids]


@torch.inference_mode()
def response_nll(engine, prompt_ids: list[int], response_ids: list[int]) -> tuple[float, int]:
    """Sum of -log p(response token | everything before), and the token count; one prefill chunk
    on the idle engine's cache (slots from 0)."""
    ids = torch.tensor(prompt_ids + response_ids)
    hidden = engine.executor.forward(contiguous_batch(ids, 0))
    logits = engine.executor.logits(hidden[len(prompt_ids) - 1 : -1])
    logp = torch.log_softmax(logits.double(), -1)
    target = torch.tensor(response_ids)
    return float(-logp[torch.arange(len(response_ids)), target].sum()), len(response_ids)


def answer_perplexity(engine, refs: list[tuple[list[dict], str]], max_context: int) -> dict:
    """``{"tokens": n, "perplexity": exp(mean NLL)}`` of the reference answers given their questions
    (:func:`response_nll`), skipping rows longer than ``max_context`` tokens."""
    nll = n = 0
    for messages, answer in tqdm(refs, desc="perplexity", leave=False):
        p, r = engine.encode_chat(messages), engine.encode_prompt(answer)
        if len(p) + len(r) > max_context:
            continue
        a, b = response_nll(engine, p, r)
        nll, n = nll + a, n + b
    return {"tokens": n, "perplexity": math.exp(nll / n) if n else None}


def greedy_agreement(engine_a, engine_b, rows: list[dict], max_tokens: int) -> dict:
    """Greedy outputs of two engines on the chat ``rows``: ``{"prompts", "identical",
    "mean_common_prefix"}`` (tokens)."""
    same = prefix = 0
    for row in tqdm(rows, desc="greedy agreement", leave=False):
        ids = engine_a.encode_chat(row["messages"])
        a, b = greedy(engine_a, ids, max_tokens), greedy(engine_b, ids, max_tokens)
        same += a == b
        prefix += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"prompts": len(rows), "identical": same, "mean_common_prefix": prefix / len(rows) if rows else 0.0}


def fmt(ppl: float | None) -> str:
    return "-" if ppl is None else f"{ppl:.4f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--prompts", required=True, help="JSONL of chat rows (e.g. ../shared/datasets/broad/dev.jsonl)")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens compared per prompt")
    ap.add_argument("--repeats", type=int, default=2, help="TTFT measurements per prompt and engine")
    ap.add_argument("--reference", help="JSONL of questions with reference answers, for perplexity")
    ap.add_argument("--num-reference", type=int, default=100)
    ap.add_argument("--max-context", type=int, default=1024, help="skip rows longer than this (prompt + response)")
    ap.add_argument("--out", default="benchmarks/results/prefill_precision")
    args = ap.parse_args()

    engines = {}
    for dtype in ("float32", "bfloat16"):
        cfg = load_config(args.config)
        cfg.engine.prefill_dtype = dtype
        engines[dtype] = build_engine(cfg)
        assert engines[dtype].prefill_dtype == dtype
    e32 = engines["float32"]
    rows = load_rows(args.prompts, args.num_prompts)
    ttft = {d: [] for d in engines}
    same, prefix, nll, count = 0, [], {d: 0.0 for d in engines}, 0
    for row in tqdm(rows, desc="prompts"):
        prompt_ids = e32.encode_chat([m for m in row["messages"] if m["role"] != "assistant"])
        for _ in range(args.repeats):
            for d, e in engines.items():
                ttft[d].append(ttft_ms(e, prompt_ids))
        a, b = (greedy(engines[d], prompt_ids, args.max_tokens) for d in ("float32", "bfloat16"))
        same += a == b
        prefix.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    references = load_references(args.reference, args.num_reference) if args.reference else []
    for messages, answer in tqdm(references, desc="perplexity"):
        prompt_ids = e32.encode_chat(messages)
        response_ids = e32.tokenizer.encode(answer, add_special_tokens=False)
        if 0 < len(response_ids) and len(prompt_ids) + len(response_ids) <= args.max_context:
            for d, e in engines.items():
                nll[d] += response_nll(e, prompt_ids, response_ids)[0]
            count += len(response_ids)
    result = {
        "args": vars(args),
        "prompts": len(rows),
        "ttft_p50_ms": {d: statistics.median(v) for d, v in ttft.items()},
        "greedy_identical": same / len(rows),
        "greedy_common_prefix_mean": statistics.mean(prefix),
        "perplexity": {d: math.exp(nll[d] / count) if count else None for d in engines},
        "perplexity_tokens": count,
    }
    p = result["perplexity"]
    table = "\n".join([
        f"{len(rows)} prompts from {Path(args.prompts).name}, greedy, {args.max_tokens} tokens compared, "
        f"perplexity over {count} reference answer tokens"
        + (f" ({Path(args.reference).name})" if args.reference else ""),
        "",
        "| prefill | TTFT p50 ms | perplexity | greedy output identical to float32 | mean common prefix (tokens) |",
        "|---|---|---|---|---|",
        f"| float32 | {result['ttft_p50_ms']['float32']:.0f} | {fmt(p['float32'])} | - | - |",
        f"| bfloat16 | {result['ttft_p50_ms']['bfloat16']:.0f} | {fmt(p['bfloat16'])} | "
        f"{100 * result['greedy_identical']:.0f}% | {result['greedy_common_prefix_mean']:.1f} of {args.max_tokens} |",
    ])
    write_report(args.out, table, result)
    print(table)


if __name__ == "__main__":
    main()
