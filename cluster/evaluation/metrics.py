"""Serving metrics from per-request records, with the definitions of vLLM's ``bench serve``.

- TTFT (time to first token): request sent -> first chunk that carries content, in seconds.
- TPOT (time per output token), per request: ``(latency_s - ttft_s) / (output_tokens - 1)``;
  undefined for one-token outputs, which are left out of the TPOT percentiles.
- ITL (inter-token latency): the gaps between consecutive content chunks of a request, pooled over
  requests. A chunk may carry several tokens (a speculative step emits accepted tokens together), so
  ITL is per chunk, not per token.
- E2E latency: request sent -> last byte of the response.
- Request throughput: completed requests / run duration (requests/s); output-token throughput:
  output tokens of completed requests / run duration (tokens/s).
- Goodput: completed requests that meet every given SLO (TTFT, TPOT, E2E latency) / run duration
  (requests/s).

All functions are pure: records in, numbers out. Summaries report milliseconds (``*_ms``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; ``None`` = not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def as_dict(self) -> dict:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms}


def distribution_ms(values_s: Iterable[float]) -> dict:
    """``{"mean", "p50", "p90", "p99", "n"}`` in milliseconds of values given in seconds.

    Percentiles by linear interpolation (``numpy.percentile``), as vLLM does; all None when empty.
    """
    arr = np.asarray([v for v in values_s if v is not None], dtype=float) * 1e3
    if arr.size == 0:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}, "n": 0}
    out = {"mean": float(arr.mean())}
    out.update({f"p{q}": float(np.percentile(arr, q)) for q in PERCENTILES})
    out["n"] = int(arr.size)
    return out


def tpot_s(latency_s: float, ttft_s: float | None, output_tokens: int) -> float | None:
    """Time per output token after the first, in seconds; None for fewer than 2 tokens."""
    if ttft_s is None or output_tokens < 2:
        return None
    return (latency_s - ttft_s) / (output_tokens - 1)


def meets_slo(ttft_s: float | None, tpot: float | None, latency_s: float, slo: Slo) -> bool:
    """True when the request satisfies every constrained SLO (an undefined TPOT satisfies it)."""
    if slo.ttft_ms is not None and (ttft_s is None or ttft_s * 1e3 > slo.ttft_ms):
        return False
    if slo.tpot_ms is not None and tpot is not None and tpot * 1e3 > slo.tpot_ms:
        return False
    return slo.e2e_ms is None or latency_s * 1e3 <= slo.e2e_ms


def summarize(records: Sequence, duration_s: float, slo: Slo | None = None) -> dict:
    """Aggregate ``loadgen.RequestRecord``-like objects (attributes ``ok``, ``ttft_s``, ``itl_s``,
    ``latency_s``, ``output_tokens``, ``rdserve``) of one run lasting ``duration_s`` seconds.

    Returns a JSON-ready dict: counts, throughputs (requests/s, tokens/s), goodput (requests/s,
    None without SLOs), TTFT/TPOT/ITL/E2E distributions in ms and, when the server reports it,
    mean tokens per step and the decoding modes it chose.
    """
    done = [r for r in records if r.ok]
    tpots = [tpot_s(r.latency_s, r.ttft_s, r.output_tokens) for r in done]
    out_tokens = sum(r.output_tokens for r in done)
    duration_s = max(duration_s, 1e-9)
    good = None
    if slo is not None:
        good = sum(meets_slo(r.ttft_s, t, r.latency_s, slo) for r, t in zip(done, tpots)) / duration_s
    stats = [r.rdserve for r in done if r.rdserve]
    steps = sum(s["num_steps"] for s in stats)
    modes: dict[str, int] = {}
    for s in stats:
        modes[s["mode"]] = modes.get(s["mode"], 0) + 1
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "goodput": good,
        "slo": slo.as_dict() if slo else None,
        "ttft_ms": distribution_ms(r.ttft_s for r in done),
        "tpot_ms": distribution_ms(tpots),
        "itl_ms": distribution_ms(g for r in done for g in r.itl_s),
        "e2e_latency_ms": distribution_ms(r.latency_s for r in done),
        "tokens_per_step": (steps + sum(s["accepted_draft_tokens"] for s in stats)) / steps if steps else None,
        "modes": modes,
    }
