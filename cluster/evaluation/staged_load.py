"""Step 5, staged load: speculative vs plain vs auto (the per-request mode) from low traffic to high concurrency.

Each mode runs closed-loop at every concurrency level (and, optionally, open-loop at a Poisson rate).
Speculation pays at a level when its output-token throughput is at least plain's and its median
TPOT at most plain's. The crossover is the largest level up to which it pays at every level; the
router's ``spec_max_load`` counts requests held by one replica (running + queued, the new one
included), so the recommendation is ``crossover // replicas`` (0 = never speculate under ``auto``).
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.evaluation.loadgen import LoadSpec, run_load
from cluster.evaluation.metrics import Slo
from cluster.evaluation.prompts import PromptRow
from cluster.evaluation.target import Target

MODES = ("spec", "plain", "auto")


def spec_pays(spec: dict, plain: dict) -> bool:
    """True when speculative decoding matches or beats plain on throughput and median TPOT."""
    s_tpot, p_tpot = spec["tpot_ms"]["p50"], plain["tpot_ms"]["p50"]
    return (spec["output_throughput"] >= plain["output_throughput"]
            and s_tpot is not None and p_tpot is not None and s_tpot <= p_tpot)


def speculation_snippet(spec_max_load: int) -> str:
    """The config lines a decision amounts to (merged into the config's ``speculation:`` section)."""
    return f"speculation:\n  spec_max_load: {spec_max_load}\n"


def decide(levels: Sequence[int], spec: Sequence[dict], plain: Sequence[dict], replicas: int = 1) -> dict:
    """Where speculation pays; ``speculation.spec_max_load`` for the config.

    levels: closed-loop concurrency levels, ascending; spec/plain: the summaries at those levels.
    """
    pays = [spec_pays(s, p) for s, p in zip(spec, plain)]
    crossover = 0
    for level, ok in zip(levels, pays):
        if not ok:
            break
        crossover = level
    spec_max_load = crossover // max(1, replicas)
    return {"pays_by_level": dict(zip((str(c) for c in levels), pays)), "crossover_concurrency": crossover,
            "spec_max_load": spec_max_load, "speculation_yaml": speculation_snippet(spec_max_load)}


def run_staged(target: Target, prompts: Sequence[PromptRow], *, levels: Sequence[int], max_tokens: int,
               requests_per_level: int, duration_s: float, rate: float | None = None, slo: Slo | None = None,
               replicas: int = 1, modes: Sequence[str] = MODES, progress: bool = True) -> dict:
    """All runs and the decision. ``requests_per_level`` is scaled up to at least twice the level."""
    levels = sorted(set(levels))
    closed: dict[str, list[dict]] = {m: [] for m in modes}
    open_loop: dict[str, dict] = {}
    for mode in modes:
        for level in levels:
            spec = LoadSpec(model=target.model, max_tokens=max_tokens, mode=mode, concurrency=level,
                            max_requests=max(requests_per_level, 2 * level), duration_s=duration_s)
            closed[mode].append(run_load(target.base_url, prompts, spec, target.count_tokens, progress).summary(slo))
        if rate is not None:
            spec = LoadSpec(model=target.model, max_tokens=max_tokens, mode=mode, concurrency=None, rate=rate,
                            max_requests=requests_per_level, duration_s=duration_s)
            open_loop[mode] = run_load(target.base_url, prompts, spec, target.count_tokens, progress).summary(slo)
    out = {"levels": levels, "max_tokens": max_tokens, "slo": slo.as_dict() if slo else None, "closed_loop": closed,
           "open_loop": {"rate": rate, "by_mode": open_loop} if rate is not None else None}
    if "spec" in closed and "plain" in closed:
        out["decision"] = decide(levels, closed["spec"], closed["plain"], replicas)
    return out
