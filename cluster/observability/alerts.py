"""Prometheus alert rules and the scrape config for rdserve, as code.

``rdserve observability prometheus-config`` writes both (:func:`write_prometheus_files`); the rules
pass ``promtool check rules`` and have ``promtool test rules`` unit tests
(``cluster/observability/alerts_test.yml``, run by ``tests/cluster/observability/test_alerts.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from cluster.observability.metrics import exported as x

RULES_FILE = "rdserve-alerts.yml"
CONFIG_FILE = "prometheus.yml"


@dataclass(frozen=True)
class AlertThresholds:
    """Alert thresholds: ``ttft_p90_s`` (TTFT SLO, p90 over 5 min, seconds), ``error_ratio`` (5xx /
    requests over 5 min), ``min_acceptance_length`` (mean acceptance length while speculating, over
    10 min), ``max_replica_changes`` (autoscaling-target changes in 30 min), ``kv_usage`` (0-1);
    ``for_s``: how long a condition holds before the alert fires; ``min_request_rate`` (requests/s
    over 5 min): below it the TTFT and error-rate alerts stay silent (a p90 or a ratio of a handful
    of requests is noise: one slow or failed request would page)."""

    ttft_p90_s: float = 2.0
    error_ratio: float = 0.05
    min_acceptance_length: float = 1.1
    max_replica_changes: int = 6
    kv_usage: float = 0.95
    for_s: int = 300
    min_request_rate: float = 0.02


def _rate(name: str, window: str, by: str = "model_name", sel: str = "") -> str:
    selector = f"{{{sel}}}" if sel else ""
    return f"sum by ({by}) (rate({x(name)}{selector}[{window}]))"


def alert_rules(t: AlertThresholds = AlertThresholds()) -> dict:
    """The rules file as a mapping (Prometheus rule-file format, one group ``rdserve``)."""
    hold = f"{t.for_s}s"
    ttft = (f"histogram_quantile(0.9, sum by (le, model_name, deployment) "
            f"(rate({x('time_to_first_token_seconds')}_bucket[5m]))) > {t.ttft_p90_s} "
            f"and sum by (model_name, deployment) (rate({x('time_to_first_token_seconds')}_count[5m])) "
            f">= {t.min_request_rate}")
    # A Ray counter has no series until its first increment: "or X * 0" stands in for a count that never
    # grew (every request failed, no draft token ever accepted), the very cases these alerts are for.
    failures_5xx, failures = _rate("request_failure", "5m", sel='status=~"5.."'), _rate("request_failure", "5m")
    requests = f"(({_rate('request_success', '5m')} or {failures} * 0) + {failures})"
    drafts = _rate("spec_decode_num_drafts", "10m", "model_name, deployment")
    accepted = _rate("spec_decode_num_accepted_tokens", "10m", "model_name, deployment")
    acceptance = f"(1 + ({accepted} or {drafts} * 0) / {drafts}) < {t.min_acceptance_length} and {drafts} > 0"
    rules = [
        _alert("RdserveTTFTSLOBreach", ttft, hold, "warning",
               "TTFT p90 of {{ $labels.model_name }} ({{ $labels.deployment }}) is {{ $value | humanizeDuration }}",
               f"Time to first token p90 over 5 min is above the SLO of {t.ttft_p90_s} s (with at least "
               f"{t.min_request_rate} requests/s): requests queue "
               "(add replicas, see serve.autoscaling) or prompts are long (engine.max_prefill_chunk)."),
        _alert("RdserveHighErrorRate", f"{failures_5xx} / {requests} > {t.error_ratio} and {requests} >= "
               f"{t.min_request_rate}", hold, "critical",
               "{{ $value | humanizePercentage }} of {{ $labels.model_name }} requests fail with 5xx",
               f"More than {t.error_ratio:.0%} of requests over 5 min (at least {t.min_request_rate} requests/s) "
               "ended with a server error (500 engine "
               "error, 503 overload or drain, 504 timeout); see the replicas' logs."),
        _alert("RdserveSpecAcceptanceCollapse", acceptance, hold, "warning",
               "Speculation on {{ $labels.model_name }} ({{ $labels.deployment }}) accepts almost nothing: "
               "mean acceptance length {{ $value }}",
               f"Mean acceptance length (1 + accepted / drafts) over 10 min is below {t.min_acceptance_length} "
               "while drafting: every draft tree costs compute and saves none. The traffic has drifted from what "
               "the drafter was trained on; use speculation.policy auto (turns itself down) or retrain it."),
        _alert("RdserveReplicasFlapping",
               f"sum by (application, deployment) (changes(ray_serve_autoscaling_target_replicas[30m])) "
               f"> {t.max_replica_changes}", "0s", "warning",
               "Replica target of {{ $labels.application }}/{{ $labels.deployment }} changed {{ $value }} times "
               "in 30 min",
               "The autoscaler keeps adding and removing replicas (each start loads the model): raise "
               "downscale_delay_s or widen the gap between target_ongoing_requests and the load."),
        _alert("RdserveKVCacheNearFull", f"max by (model_name, deployment, replica) ({x('kv_cache_usage_perc')}) "
               f"> {t.kv_usage}", hold, "warning",
               "KV cache of {{ $labels.replica }} ({{ $labels.model_name }}) is {{ $value | humanizePercentage }} full",
               f"Paged KV cache usage above {t.kv_usage:.0%}: new requests wait and running ones are preempted; "
               "add replicas or raise engine.kv_cache_fraction / num_kv_blocks."),
    ]
    return {"groups": [{"name": "rdserve", "rules": rules}]}


def _alert(name: str, expr: str, hold: str, severity: str, summary: str, description: str) -> dict:
    return {"alert": name, "expr": expr, "for": hold, "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description}}


def prom_duration(seconds: float) -> str:
    """A Prometheus duration: ``15`` -> ``"15s"``, ``0.25`` -> ``"250ms"`` (Prometheus rejects ``"0.25s"``).

    Raises:
        ValueError: under 1 ms.
    """
    ms = round(seconds * 1000)
    if ms < 1:
        raise ValueError(f"a Prometheus duration must be at least 1 ms, got {seconds} s")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def scrape_config(targets: list[str], scrape_interval_s: float = 15, rules_file: str = RULES_FILE) -> dict:
    """``prometheus.yml``: one job ``rdserve`` scraping Ray's metrics agents at ``targets``
    (``HOST:PORT``, every node's ``observability.metrics_port``), with the alert rules loaded."""
    interval = prom_duration(scrape_interval_s)
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [rules_file],
            "scrape_configs": [{"job_name": "rdserve", "metrics_path": "/metrics",
                                "static_configs": [{"targets": list(targets)}]}]}


def write_prometheus_files(out_dir: Path, targets: list[str], thresholds: AlertThresholds = AlertThresholds(),
                           scrape_interval_s: float = 15) -> tuple[Path, Path]:
    """Write ``prometheus.yml`` and ``rdserve-alerts.yml`` into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config, rules = out_dir / CONFIG_FILE, out_dir / RULES_FILE
    config.write_text(yaml.safe_dump(scrape_config(targets, scrape_interval_s), sort_keys=False))
    rules.write_text(yaml.safe_dump(alert_rules(thresholds), sort_keys=False, width=120))
    return config, rules
