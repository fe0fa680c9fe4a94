"""How many engine replicas the measured load needs (``serve.autoscaling``).

:func:`desired_replicas` is a plain function of the per-replica stats that
:mod:`cluster.replica.stats` produces; :class:`RdserveAutoscalingPolicy` adapts it to Ray Serve's
custom autoscaling policy API (``AutoscalingPolicy(policy_function=..., policy_kwargs=...)``).
Serve then applies ``min_replicas``/``max_replicas`` and the up/down-scale delays.

Rule, with ``load`` the requests a replica holds (decoding, queued in its engine or tokenizing):

1. demand: ``ceil((sum of load + requests queued in Serve's handles) / target_ongoing_requests)``;
2. pressure: when some replica keeps more than ``waiting_threshold`` requests queued in its engine
   *and* the replicas are short of KV cache (mean ``kv_usage`` above ``kv_usage_target``) or miss the
   TTFT objective (worst ``ttft_p90_s`` above ``slo_ttft_s``), the load does not fit the replicas
   whatever the count says: ask for one more than now;
3. at least 1; and no decision (hold the current count) while no replica has reported stats.

Serve averages each reported number over ``look_back_period_s`` (time-weighted mean) before the
policy sees it. Like Ray Serve LLM's TTFT policy (``ray.serve.llm.autoscaling``, master), the SLO
term only ever adds a replica; removing one is left to the demand term and ``downscale_delay_s``.

This module imports nothing from the project: Serve pickles it by value into its controller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ScalingSettings:
    """``target_ongoing_requests``: requests per replica the demand term aims at (> 0).
    ``kv_usage_target``: mean KV-cache usage (0-1) above which waiting requests mean pressure.
    ``slo_ttft_s``: TTFT p90 objective in seconds, None = not used.
    ``waiting_threshold``: requests queued in one engine (mean over the look-back window) that
    count as waiting; 1.0 ignores the odd request that waits one iteration for a batch slot."""

    target_ongoing_requests: float
    kv_usage_target: float = 0.85
    slo_ttft_s: float | None = None
    waiting_threshold: float = 1.0


def under_pressure(stats: list[dict], settings: ScalingSettings) -> bool:
    """True when some replica has waiting requests and the replicas lack KV cache or miss the TTFT SLO.

    ``stats``: one dict per replica with ``waiting``, ``kv_usage`` and optionally ``ttft_p90_s`` (seconds).
    """
    if not any(s.get("waiting", 0.0) > settings.waiting_threshold for s in stats):
        return False
    kv = [s["kv_usage"] for s in stats if "kv_usage" in s]
    if kv and sum(kv) / len(kv) > settings.kv_usage_target:
        return True
    ttft = [s["ttft_p90_s"] for s in stats if s.get("ttft_p90_s") is not None]
    return settings.slo_ttft_s is not None and bool(ttft) and max(ttft) > settings.slo_ttft_s


def desired_replicas(current: int, stats: list[dict], settings: ScalingSettings, queued: float = 0.0) -> int:
    """Replicas the measured load needs (see the module docstring for the rule).

    Args:
        current: the replica count Serve aims at now (running and starting); returned unchanged
            when ``stats`` is empty (no measurement, no decision).
        stats: one dict per running replica that has reported, keys as in :mod:`cluster.replica.stats`
            (``load``, ``waiting``, ``kv_usage``, ``ttft_p90_s``; means over the look-back window).
            A replica that has not reported yet (just started) is absent and counts as no load.
        settings: the thresholds.
        queued: requests waiting in Serve's handles for a replica slot (beyond ``max_ongoing_requests``).

    Returns:
        The desired replica count, >= 1, before Serve's min/max bounds and delays.
    """
    stats = [s for s in stats if "load" in s]
    if not stats:
        return current
    demand = (sum(s["load"] for s in stats) + queued) / settings.target_ongoing_requests
    wanted = math.ceil(round(demand, 6))  # time-weighted means carry float noise: 16.0000001 / 8 is 2 replicas
    if under_pressure(stats, settings):
        wanted = max(wanted, current + 1)
    return max(1, wanted)


def stats_by_replica(aggregated_metrics: dict[str, dict] | None) -> list[dict]:
    """Serve's ``{metric: {replica_id: value}}`` as one ``{metric: value}`` dict per replica."""
    per_replica: dict = {}
    for name, values in (aggregated_metrics or {}).items():
        for replica_id, value in values.items():
            per_replica.setdefault(replica_id, {})[name] = value
    return list(per_replica.values())


class RdserveAutoscalingPolicy:
    """Ray Serve 2.60 custom autoscaling policy: ``AutoscalingPolicy(policy_function="cluster.routing.autoscaling:
    RdserveAutoscalingPolicy", policy_kwargs={...ScalingSettings fields})``.

    Serve instantiates the class once per deploy with ``policy_kwargs`` (it passes them to classes
    only, not to plain functions) and calls the instance every control-loop tick.
    """

    def __init__(self, **settings):
        self.settings = ScalingSettings(**settings)

    def __call__(self, ctx) -> tuple[int, dict]:
        """``ctx``: ``ray.serve.config.AutoscalingContext``. Returns (desired replicas, policy state)."""
        stats = stats_by_replica(ctx.aggregated_metrics)
        queued = ctx.total_queued_requests or 0.0
        return desired_replicas(ctx.target_num_replicas, stats, self.settings, queued), {}
