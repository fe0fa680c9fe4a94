"""Every rdserve metric in one table: name, type, labels, buckets and meaning.

Names follow vLLM's (``vllm/v1/metrics/loggers.py``) with our prefix: recorded as ``rdserve_<name>``
through Ray's metrics API, Ray's metrics agent exports them as ``ray_rdserve_<name>``, counters with
``_total`` (so ``prompt_tokens`` is scraped as ``ray_rdserve_prompt_tokens_total``). Every series
carries ``model_name`` and, recorded inside a Serve replica, Ray Serve's ``application``,
``deployment`` (the pool: ``EngineReplica``; ``OpenAIIngress`` when the engine runs in the ingress,
``serve.colocate``; or ``EngineReplicaSpec``/``EngineReplicaPlain`` in two-pool mode) and ``replica``. Derived figures (acceptance rate, mean acceptance length, tokens per
step) are PromQL ratios of counters, never pre-averaged gauges (see ``cluster.observability.dashboard``).

Latencies are measured at the engine replica, from the request's arrival there: they exclude HTTP
and Serve routing (Ray Serve's ``ray_serve_deployment_processing_latency_ms`` covers those).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PREFIX = "rdserve_"
EXPORTED_PREFIX = "ray_" + PREFIX

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 10.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0,
                   240.0, 480.0, 960.0)
ITERATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
                     2.5, 5.0)


@dataclass(frozen=True)
class MetricDef:
    """One metric. ``name`` without prefix (and without ``_total`` for counters); ``labels`` besides
    ``model_name`` and Ray Serve's; ``buckets`` (seconds) for histograms; ``where``: who records it."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    labels: tuple[str, ...]
    buckets: tuple[float, ...] | None
    where: Literal["replica", "engine", "ingress"]
    help: str

    @property
    def exported(self) -> str:
        """The name Prometheus scrapes (``ray_rdserve_...``, counters ending ``_total``)."""
        return EXPORTED_PREFIX + self.name + ("_total" if self.kind == "counter" else "")


C, G, H = "counter", "gauge", "histogram"
METRICS: tuple[MetricDef, ...] = (
    #         name                                        kind labels              buckets            where (help below)
    MetricDef("time_to_first_token_seconds",              H, (),                   TTFT_BUCKETS,      "replica",
              "Time to first token: arrival at the replica to the first token."),
    MetricDef("inter_token_latency_seconds",              H, (),                   TOKEN_BUCKETS,     "replica",
              "Time between consecutive outputs of a request (one per iteration; a speculative step's come at once)."),
    MetricDef("request_time_per_output_token_seconds",    H, (),                   TOKEN_BUCKETS,     "replica",
              "TPOT per request: (e2e - TTFT) / (completion tokens - 1)."),
    MetricDef("e2e_request_latency_seconds",              H, (),                   REQUEST_BUCKETS,   "replica",
              "Arrival at the replica to the last token."),
    MetricDef("request_queue_time_seconds",               H, (),                   REQUEST_BUCKETS,   "engine",
              "Added to the engine to first scheduled."),
    MetricDef("request_prefill_time_seconds",             H, (),                   REQUEST_BUCKETS,   "engine",
              "First scheduled to first token (context phase)."),
    MetricDef("request_decode_time_seconds",              H, (),                   REQUEST_BUCKETS,   "engine",
              "First token to last token (generation phase)."),
    MetricDef("iteration_seconds",                        H, ("kind",),            ITERATION_BUCKETS, "engine",
              "One engine iteration (schedule, draft, forward, accept); kind: context, plain, spec or mixed."),
    MetricDef("prompt_tokens",                            C, (),                   None,              "engine",
              "Prompt tokens of requests that got their first token."),
    MetricDef("generation_tokens",                        C, (),                   None,              "engine",
              "Emitted completion tokens (never tokens after EOS, a stop string or max_tokens)."),
    MetricDef("request_success",                          C, ("finished_reason",), None,              "replica",
              "Finished requests by finish reason: stop, length, or abort (client went away)."),
    MetricDef("request_failure",                          C, ("status",),          None,              "ingress",
              "Requests answered with an HTTP error status, or whose stream ended with an error (500)."),
    MetricDef("num_preemptions",                          C, (),                   None,              "engine",
              "Requests preempted (KV blocks freed, context recomputed later)."),
    MetricDef("num_requests_running",                     G, (),                   None,              "engine",
              "Requests in the running batch."),
    MetricDef("num_requests_waiting",                     G, (),                   None,              "engine",
              "Requests waiting for the running batch: in the engine's queue, and in the ingress's when the engine "
              "runs there (serve.colocate; with a separate engine deployment Serve's queue is "
              "ray_serve_deployment_queued_queries)."),
    MetricDef("kv_cache_usage_perc",                      G, (),                   None,              "engine",
              "Paged KV cache usage, 0-1 (used blocks / blocks)."),
    MetricDef("generation_steps",                         C, (),                   None,              "engine",
              "Generation-phase steps of requests, drafting or plain: tokens per step = (accepted + steps) / steps."),
    MetricDef("spec_decode_num_drafts",                   C, (),                   None,              "engine",
              "Draft trees verified (one per request per speculative step)."),
    MetricDef("spec_decode_num_draft_tokens",             C, (),                   None,              "engine",
              "Draft tokens offered: each tree's depth (draft_len_per_beam, fewer near max_tokens)."),
    MetricDef("spec_decode_num_accepted_tokens",          C, (),                   None,              "engine",
              "Draft tokens accepted by the base model and emitted."),
    MetricDef("prefix_cache_queries",                     C, (),                   None,              "engine",
              "Prompt tokens looked up in the prefix cache at admission (vLLM's name); none with "
              "engine.enable_prefix_caching off or for requests that ask for prompt logprobs (they compute every position)."),
    MetricDef("prefix_cache_hits",                        C, (),                   None,              "engine",
              "Prompt tokens found in the prefix cache (their prefill skipped); hit rate = hits / queries."),
    MetricDef("spec_decode_num_grammar_rejected_tokens",  C, (),                   None,              "engine",
              "Draft tokens offered but not accepted because the request's grammar (structured output, tool "
              "calls) forbade the next drafted token; the rest of the rejections are the base model's."),
    MetricDef("spec_decode_num_accepted_tokens_per_pos",  C, ("position",),        None,              "engine",
              "Drafts whose accepted path reached draft position (0-based) position."),
    MetricDef("spec_decode_num_beams",                    G, (),                   None,              "engine",
              "num_beams of the replica's last generation iteration (0: plain)."),
    MetricDef("spec_decode_draft_len_per_beam",           G, (),                   None,              "engine",
              "draft_len_per_beam of the replica's last generation iteration (0: plain)."),
    MetricDef("router_decisions",                         C, ("mode", "reason"),   None,              "replica",
              "The router's per-request decoding mode, by reason (cluster.replica.spec_mode.choose_mode)."),
)
BY_NAME = {m.name: m for m in METRICS}

ROUTER_REASONS = {  # choose_mode's reason text (prefix) -> the reason label
    "no drafter loaded": "no_drafter",
    "speculation off": "spec_off",
    "requested": "requested",
    "default_mode": "default_mode",
    "auto: the goodput model": "auto_goodput",
    "auto: load": "auto_load",
}


LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "finished_reason": ("stop", "length", "abort"),
    "status": ("400", "401", "404", "413", "500", "503", "504"),  # what rdserve answers; others appear when used
    "mode": ("spec", "plain"),
    "reason": (*ROUTER_REASONS.values(), "other"),
}
"""The known values of the counters' labels. A counter has no series until it is recorded (a rare event's
panel would say "No data", a rate over it would be empty), so a replica records each combination at zero
when it starts (:func:`cluster.observability.recorder.start_at_zero`). ``position`` is 0 to the
replica's draft_len_per_beam - 1 (:func:`known_label_values`). Histograms are not: a zero observation
would count; their series appear with the first request."""


def known_label_values(spec: MetricDef, draft_len: int) -> dict[str, tuple[str, ...]]:
    """``{label: values}`` a replica starts ``spec`` with; ``draft_len``: the replica's draft_len_per_beam
    (0 without a drafter: no ``position`` series until one is reached).

    Raises:
        KeyError: a label of ``spec`` with no known values (a histogram's ``kind``).
    """
    return {label: tuple(map(str, range(draft_len))) if label == "position" else LABEL_VALUES[label]
            for label in spec.labels}


def reason_label(reason: str) -> str:
    """A bounded label for :func:`cluster.replica.spec_mode.choose_mode`'s free-text reason (its numbers would
    make a series per value); ``other`` for text this table does not know."""
    return next((label for prefix, label in ROUTER_REASONS.items() if reason.startswith(prefix)), "other")


def exported(name: str) -> str:
    """``exported("generation_tokens")`` -> ``"ray_rdserve_generation_tokens_total"``.

    Raises:
        KeyError: not a metric of :data:`METRICS`.
    """
    return BY_NAME[name].exported
