"""Measure what the speculation schedule is derived from, on the running machine.

Two measurements on a loaded :class:`~workers.engine.Engine`:

- :func:`measure_step_s`: seconds per generation-phase iteration with ``batch_size`` requests,
  plain or with a fixed draft-tree shape (drafting + tree verification + acceptance + KV
  compaction: everything an iteration does).
- :func:`measure_tokens_per_step`: mean tokens per step (accepted draft tokens + 1) of a shape on
  given prompts, greedy (ReDrafter arXiv 2403.09919 Sec. 4 reports the same quantity).

:func:`workers.speculation.schedule.derive_schedule` turns them into the table
``batch size -> (num_beams, draft_len_per_beam) | off``.
"""

from __future__ import annotations

import statistics
import time

import torch

from workers.engine import Engine
from workers.sampling import SamplingParams
from workers.speculation.schedule import Shape, TablePolicy, fixed_schedule


def measure_step_s(engine: Engine, batch_size: int, shape: Shape | None, *, context_len: int = 256,
                   repeats: int = 8, warmup: int = 2, seed: int = 0,
                   prompts: list[list[int]] | None = None) -> float:
    """Median seconds of one iteration with ``batch_size`` generation requests, each with
    ``context_len`` cached tokens, decoding with ``shape`` (None: plain).

    The contexts are random tokens, or with ``prompts`` real text: request i's context is
    ``prompts[i], prompts[i + 1], ...`` (cyclic) joined and cut to ``context_len`` tokens. Real
    text makes the draft trees what traffic makes them: how often beams share prefixes, and
    whether a prompt-lookup beam (``speculation.prompt_lookup_num_tokens``) finds a match, which on
    random tokens it almost never does.

    Raises:
        RuntimeError: the engine holds other requests (the measurement needs it to itself), or
            the requests do not all reach the generation phase (KV cache or budgets too small).
    """
    if engine.num_unfinished:
        raise RuntimeError("measure_step_s needs an idle engine")
    saved = engine.spec_policy
    engine.spec_policy = TablePolicy(fixed_schedule(shape, batch_size))
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.config.vocab_size
    draft = engine.runner.max_draft_depth(shape) + 1 if shape else 1  # most tokens one step may emit
    params = SamplingParams(max_tokens=(repeats + warmup + 2) * draft + 1, ignore_eos=True)
    ids = [f"calibrate-{i}" for i in range(batch_size)]
    try:
        for i, rid in enumerate(ids):
            if prompts:
                prompt, j = [], i
                while len(prompt) < context_len:
                    prompt += prompts[j % len(prompts)]
                    j += 1
                prompt = prompt[:context_len]
            else:
                prompt = torch.randint(3, vocab, (context_len,), generator=gen).tolist()
            engine.add_request(rid, prompt, params, "spec" if shape else "plain")
        for _ in range(10_000):  # context phase (chunked prefill) until every request generates
            engine.step()
            if not any(s.is_prefill for s in engine.scheduler.running) and not engine.scheduler.waiting:
                break
        if len(engine.scheduler.running) != batch_size:
            raise RuntimeError(f"only {len(engine.scheduler.running)} of {batch_size} requests fit the engine")
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            engine.step()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.spec_policy = saved


def measure_tokens_per_step(engine: Engine, prompts: list[list[int]], shape: Shape, *,
                            max_tokens: int = 96) -> float:
    """Mean tokens per generation step (accepted draft tokens + 1) over ``prompts``, greedy, each
    prompt alone with the draft-tree shape ``shape``.

    Raises:
        ValueError: the engine has no drafter, or ``prompts`` is empty.
    """
    if not engine.speculative_available:
        raise ValueError("measuring tokens per step needs a drafter")
    if not prompts:
        raise ValueError("no prompts to measure tokens per step on")
    saved = engine.spec_policy
    engine.spec_policy = TablePolicy(fixed_schedule(shape, 1))
    steps = accepted = 0
    try:
        for prompt in prompts:
            last = None
            for last in engine.generate(prompt, SamplingParams(max_tokens=max_tokens), "spec", "calibrate-tps"):
                pass
            steps += last.num_steps
            accepted += last.accepted_draft_tokens
    finally:
        engine.spec_policy = saved
    return (accepted + steps) / steps if steps else 1.0
