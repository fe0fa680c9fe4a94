"""Step 1, baseline: the served model with speculation off (``rdserve.mode = plain``).

Model, precision (dtype), context length and ReDrafter shape are fixed by the config; output length
(``max_tokens``) and closed-loop concurrency by the caller. Figures as in ``metrics``.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.config import RdserveConfig
from cluster.evaluation.loadgen import LoadSpec, run_load
from cluster.evaluation.metrics import Slo
from cluster.evaluation.prompts import PromptRow
from cluster.evaluation.target import Target


def run_baseline(target: Target, cfg: RdserveConfig, prompts: Sequence[PromptRow], *, max_tokens: int,
                 concurrency: int = 1, max_requests: int | None = None, duration_s: float = 120.0,
                 slo: Slo | None = None, progress: bool = True) -> dict:
    """One plain-decoding run; default ``max_requests`` = one pass over the prompts."""
    spec = LoadSpec(model=target.model, max_tokens=max_tokens, temperature=0.0, mode="plain",
                    concurrency=concurrency, max_requests=max_requests or len(prompts), duration_s=duration_s)
    run = run_load(target.base_url, prompts, spec, target.count_tokens, progress)
    settings = {"model": target.model, "dtype": cfg.engine.dtype, "max_seq_len": cfg.engine.max_seq_len,
                "max_tokens": max_tokens, "concurrency": concurrency, "temperature": 0.0, "mode": "plain"}
    return {"settings": settings, "summary": run.summary(slo)}
