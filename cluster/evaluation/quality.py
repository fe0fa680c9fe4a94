"""Step 4, quality regression: speculative output against plain output through the served API.

- Greedy: both modes at temperature 0, compared token by token (the streamed text re-tokenized with
  the model's tokenizer), and their logprobs (each output token's, from the server) over the tokens
  both runs share. ReDrafter's greedy acceptance is lossless, so in float32 the mismatch
  count must be zero, and so must the logprob differences on a compute path whose rows do not depend
  on the rows beside them (float32, GGUF int8). In bfloat16/float16 a different accumulation order may flip a near-tie: a
  mismatch is tolerated only where the plain run's top-2 log-probability gap at the first differing
  position is below ``tolerance`` (nats). Every mismatch is listed with prompt, position and gap.
- Sampled: ``samples`` completions per prompt per mode at temperature 1; the pooled output-token
  distributions are compared by total variation distance, against the distance between two plain
  runs with different seeds (the noise floor). Within noise: TV(spec, plain) <= 1.5 x floor + 0.05.
- Task checks where the category allows (``task_checks``), output format (same finish_reason in
  both modes) and stop behaviour (no stop string in the output).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from cluster.evaluation.loadgen import LoadSpec, RunResult, run_load
from cluster.evaluation.prompts import PromptRow
from cluster.evaluation.target import Target
from cluster.evaluation.task_checks import task_check

GapFn = Callable[[PromptRow, list[int]], float]


def first_mismatch(plain: Sequence[int], spec: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts); None when identical."""
    for i, (a, b) in enumerate(zip(plain, spec)):
        if a != b:
            return i
    return None if len(plain) == len(spec) else min(len(plain), len(spec))


def greedy_verdict(mismatches: Sequence[dict], dtype: str, tolerance: float) -> bool:
    """float32: no mismatch at all; half precision: every mismatch at a gap below ``tolerance``."""
    if dtype == "float32":
        return not mismatches
    return all(m["gap"] is not None and m["gap"] < tolerance for m in mismatches)


def total_variation(a: Counter, b: Counter) -> float:
    """Total variation distance between two token-count histograms (0 = same, 1 = disjoint)."""
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        return 0.0 if na == nb else 1.0
    return 0.5 * sum(abs(a[t] / na - b[t] / nb) for t in set(a) | set(b))


def _run(target: Target, prompts, *, mode: str, max_tokens: int, temperature: float = 0.0, repeats: int = 1,
         seed: int = 0, progress: bool) -> RunResult:
    spec = LoadSpec(model=target.model, max_tokens=max_tokens, temperature=temperature, mode=mode,
                    concurrency=1, max_requests=len(prompts) * repeats, duration_s=3600.0, seed=seed,
                    logprobs=temperature == 0.0)
    return run_load(target.base_url, prompts, spec, target.count_tokens, progress)


def compare_logprobs(plain: RunResult, spec: RunResult) -> dict:
    """Per-token logprob differences over each prompt's shared prefix of tokens (up to the first
    differing token or the shorter output): the largest absolute difference and the prompts with any."""
    worst, differing = 0.0, []
    for p, s in zip(plain.records, spec.records):
        n = len(p.logprobs) if p.text == s.text else 0  # a text mismatch is the greedy check's to report
        diffs = [abs(a - b) for a, b in zip(p.logprobs[:n], s.logprobs[:n])]
        if diffs and max(diffs) > 0:
            differing.append({"prompt_index": p.prompt_index, "max_abs_diff": max(diffs)})
        worst = max([worst, *diffs])
    return {"compared_tokens": sum(len(p.logprobs) for p, s in zip(plain.records, spec.records) if p.text == s.text),
            "max_abs_diff": worst, "prompts_differing": differing}


def compare_greedy(plain: RunResult, spec: RunResult, prompts: Sequence[PromptRow], encode: Callable[[str], list[int]],
                   dtype: str, tolerance: float, gap_fn: Callable[[], GapFn] | None) -> dict:
    """Token-by-token comparison of two greedy runs over the same prompts (same order)."""
    mismatches, gap = [], None
    for p, s in zip(plain.records, spec.records):
        plain_ids, spec_ids = encode(p.text), encode(s.text)
        pos = first_mismatch(plain_ids, spec_ids)
        if pos is None:
            continue
        row = prompts[p.prompt_index]
        if dtype != "float32" and gap_fn is not None:
            gap = gap or gap_fn()
        mismatches.append({
            "prompt_index": p.prompt_index, "category": row.category, "prompt": row.text[:200], "position": pos,
            "plain_token": plain_ids[pos] if pos < len(plain_ids) else None,
            "spec_token": spec_ids[pos] if pos < len(spec_ids) else None,
            "gap": gap(row, plain_ids[:pos]) if gap is not None else None,
        })
    return {"compared": len(plain.records), "mismatches": mismatches, "dtype": dtype, "tolerance": tolerance,
            "passed": greedy_verdict(mismatches, dtype, tolerance)}


def compare_sampled(target: Target, prompts: Sequence[PromptRow], encode, *, max_tokens: int, samples: int,
                    progress: bool) -> dict:
    """TV distance of pooled output-token histograms: spec vs plain, and plain vs plain (noise floor)."""
    def histogram(mode: str, seed: int) -> Counter:
        run = _run(target, prompts, mode=mode, max_tokens=max_tokens, temperature=1.0, repeats=samples, seed=seed,
                   progress=progress)
        return Counter(t for r in run.records if r.ok for t in encode(r.text))

    plain, plain_again, spec = histogram("plain", 0), histogram("plain", 100_000), histogram("spec", 0)
    tv, floor = total_variation(spec, plain), total_variation(plain_again, plain)
    return {"samples_per_prompt": samples, "temperature": 1.0, "tv_spec_vs_plain": tv, "tv_plain_vs_plain": floor,
            "within_noise": tv <= 1.5 * floor + 0.05}


def task_and_format_checks(plain: RunResult, spec: RunResult, prompts: Sequence[PromptRow]) -> dict:
    """Task pass counts per mode and check, finish_reason agreement, stop strings leaked into outputs."""
    tasks: dict[str, dict[str, int]] = {}
    finish_differs, stop_leaks = [], []
    for p, s in zip(plain.records, spec.records):
        row = prompts[p.prompt_index]
        for mode, rec in (("plain", p), ("spec", s)):
            check = task_check(row.category, rec.text, row.reference)
            if check is not None:
                counts = tasks.setdefault(check[0], {"n": 0, "plain": 0, "spec": 0})
                counts["n"] += mode == "plain"
                counts[mode] += check[1]
            if any(stop in rec.text for stop in row.stop):
                stop_leaks.append({"prompt_index": p.prompt_index, "mode": mode})
        if p.finish_reason != s.finish_reason:
            finish_differs.append({"prompt_index": p.prompt_index, "plain": p.finish_reason, "spec": s.finish_reason})
    return {"task_checks": tasks, "finish_reason_differs": finish_differs, "stop_string_leaks": stop_leaks}


def run_quality(target: Target, prompts: Sequence[PromptRow], encode: Callable[[str], list[int]], *, dtype: str,
                max_tokens: int, tolerance: float = 0.1, samples: int = 0,
                gap_fn: Callable[[], GapFn] | None = None, progress: bool = True) -> dict:
    """All quality checks. ``gap_fn`` builds the top-2 gap function lazily (in half precision only)."""
    plain = _run(target, prompts, mode="plain", max_tokens=max_tokens, progress=progress)
    spec = _run(target, prompts, mode="spec", max_tokens=max_tokens, progress=progress)
    failed = [r.error for r in plain.records + spec.records if not r.ok]
    if failed:
        raise RuntimeError(f"quality: {len(failed)} request(s) failed, first: {failed[0]}")
    out = {"greedy": {**compare_greedy(plain, spec, prompts, encode, dtype, tolerance, gap_fn),
                      "logprobs": compare_logprobs(plain, spec)},
           **task_and_format_checks(plain, spec, prompts),
           "served_tokens_per_step": spec.summary()["tokens_per_step"]}
    if samples > 0:
        out["sampled"] = compare_sampled(target, prompts, encode, max_tokens=max_tokens, samples=samples,
                                         progress=progress)
    return out


def engine_top2_gap(cfg) -> GapFn:
    """Top-2 log-probability gap (nats) of the plain model's next token after ``prompt + prefix``,
    computed in this process with an Engine built from ``cfg`` (a context-phase forward)."""
    import torch

    from cluster.replica.build import build_engine
    from workers.forward_batch import contiguous_batch

    engine = build_engine(cfg)
    # the cache the served engine keeps (engine.kv_cache_dtype), so the gaps are the served model's
    kv_dtype = None if cfg.engine.kv_cache_dtype == "auto" else getattr(torch, cfg.engine.kv_cache_dtype)

    @torch.inference_mode()
    def gap(row: PromptRow, prefix: list[int]) -> float:
        ids = (engine.encode_chat(row.messages) if row.messages is not None else engine.encode_prompt(row.prompt))
        ids = ids + list(prefix)
        cache = engine.model.new_cache(len(ids), kv_dtype)
        hidden = engine.model(cache, contiguous_batch(torch.tensor(ids), 0))[-1]
        top = torch.log_softmax(engine.model.logits(hidden[None]).float(), -1)[0].topk(2).values
        return float(top[0] - top[1])

    return gap
