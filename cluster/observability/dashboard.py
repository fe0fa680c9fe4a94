"""The "rdserve" Grafana dashboard, built in code with grafana-foundation-sdk.

Rows: traffic, latency, speculative decoding, engine, Ray Serve. Variables: ``datasource``
(Prometheus), ``model`` (``model_name``), ``app`` (Serve application) and ``pool`` (Serve
deployment: ``EngineReplica``, ``OpenAIIngress`` when the engine runs in the ingress (``serve.colocate``), or
``EngineReplicaSpec``/``EngineReplicaPlain`` in two-pool mode).
:data:`ROWS` holds every panel's PromQL as plain data, so tests run each query against a real
Prometheus (``tests/cluster/observability/test_prometheus_ray.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

from cluster.observability.metrics import exported as x

UID = "rdserve"
TITLE = "rdserve"
SEL = 'model_name=~"$model", deployment=~"$pool"'
SERVE_SEL = 'application=~"$app", deployment=~"$pool"'
R = "[$__rate_interval]"


@dataclass(frozen=True)
class PanelDef:
    """One time-series panel: ``targets`` are ``(PromQL, legend)``; ``unit`` a Grafana unit id."""

    title: str
    description: str
    unit: str
    targets: tuple[tuple[str, str], ...]


def _rate(name: str, by: str = "", extra: str = "") -> str:
    sel = SEL + (", " + extra if extra else "")
    return f"sum{f' by ({by})' if by else ''} (rate({x(name)}{{{sel}}}{R}))"


def _quantiles(name: str, by: str = "") -> tuple[tuple[str, str], ...]:
    by_le = f"le, {by}" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    return tuple((f"histogram_quantile({q}, sum by ({by_le}) (rate({x(name)}_bucket{{{SEL}}}{R})))",
                  f"{legend}p{int(q * 100)}") for q in (0.5, 0.9, 0.99))


DRAFTS = _rate("spec_decode_num_drafts")
ACCEPTED = f'({_rate("spec_decode_num_accepted_tokens")} or {DRAFTS} * 0)'  # no series until a first accept
SPECULATING = _rate("router_decisions", extra='mode="spec"')
ROWS: tuple[tuple[str, tuple[PanelDef, ...]], ...] = (
    ("Traffic", (
        PanelDef("Requests/s", "Finished requests per second by finish reason (stop, length, abort: the client "
                 "went away).", "reqps", ((_rate("request_success", "finished_reason"), "{{finished_reason}}"),)),
        PanelDef("Tokens/s", "Prompt tokens and emitted completion tokens per second.", "short",
                 ((_rate("prompt_tokens"), "prompt"), (_rate("generation_tokens"), "generation"))),
        PanelDef("Errors/s", "Requests answered with an HTTP error, by status (500 includes streams that ended "
                 "with an error event). 5xx are the server's; 4xx are bad requests.", "reqps",
                 ((f'sum by (status) (rate({x("request_failure")}{{model_name=~"$model"}}{R}))', "{{status}}"),)),
    )),
    ("Latency", (
        PanelDef("Time to first token", "TTFT at the engine replica (excludes HTTP and Serve routing).", "s",
                 _quantiles("time_to_first_token_seconds")),
        PanelDef("Time per output token", "TPOT per request: (e2e - TTFT) / (completion tokens - 1).", "s",
                 _quantiles("request_time_per_output_token_seconds")),
        PanelDef("End-to-end latency", "Arrival at the replica to the last token.", "s",
                 _quantiles("e2e_request_latency_seconds")),
    )),
    ("Speculative decoding", (
        PanelDef("Acceptance rate", "Accepted draft tokens / draft tokens offered (each tree's depth). Falling "
                 "toward 0 means drafts are wasted compute. Rejected by a grammar: the share a structured output's "
                 "or tool call's grammar forbade (what a schema costs in acceptance).", "percentunit",
                 ((f"{ACCEPTED} / {_rate('spec_decode_num_draft_tokens')}", "acceptance rate"),
                  (f"{_rate('spec_decode_num_grammar_rejected_tokens')} / {_rate('spec_decode_num_draft_tokens')}",
                   "rejected by a grammar"))),
        PanelDef("Mean acceptance length", "vLLM's: 1 + accepted / drafts (tokens per drafting step). Tokens per "
                 "step counts plain steps too: (accepted + steps) / steps. Near 1 while speculating: drafts are "
                 "rejected, speculation costs more than it saves.", "short",
                 ((f"1 + {ACCEPTED} / {DRAFTS}", "mean acceptance length"),
                  (f"({ACCEPTED} + {_rate('generation_steps')}) / {_rate('generation_steps')}", "tokens per step"))),
        PanelDef("Acceptance by draft position", "Share of drafts whose accepted path reached each position "
                 "(0-based); non-increasing by construction. A steep drop says shorter trees would do.",
                 "percentunit", ((f"{_rate('spec_decode_num_accepted_tokens_per_pos', 'position')} / scalar({DRAFTS})",
                                  "position {{position}}"),)),
        PanelDef("Requests speculating", "Share of requests the router sent to speculative decoding.",
                 "percentunit", ((f"{SPECULATING} / {_rate('router_decisions')}",
                                  "speculating"),)),
        PanelDef("Router decisions", "Requests per second by decoding mode and reason (cluster.replica.spec_mode).", "reqps",
                 ((_rate("router_decisions", "mode, reason"), "{{mode}}: {{reason}}"),)),
        PanelDef("Draft-tree shape per replica", "num_beams x draft_len_per_beam of each replica's last "
                 "generation iteration (0 = plain).", "short",
                 ((f'max by (replica) ({x("spec_decode_num_beams")}{{{SEL}}})', "{{replica}} num_beams"),
                  (f'max by (replica) ({x("spec_decode_draft_len_per_beam")}{{{SEL}}})', "{{replica}} draft_len"))),
    )),
    ("Engine", (
        PanelDef("Running and waiting requests", "Requests in each replica's running batch and waiting for it.",
                 "short", ((f'sum by (replica) ({x("num_requests_running")}{{{SEL}}})', "{{replica}} running"),
                           (f'sum by (replica) ({x("num_requests_waiting")}{{{SEL}}})', "{{replica}} waiting"))),
        PanelDef("KV cache usage", "Used paged-KV blocks / blocks per replica; near 1 with requests waiting, the "
                 "batch cannot grow (preemptions follow).", "percentunit",
                 ((f'max by (replica) ({x("kv_cache_usage_perc")}{{{SEL}}})', "{{replica}}"),)),
        PanelDef("Preemptions/s", "Requests preempted for KV room (their context is recomputed later).", "short",
                 ((_rate("num_preemptions"), "preemptions"),)),
        PanelDef("Iteration time", "One engine iteration by kind (context, plain, spec, mixed), p50 and p90.", "s",
                 _quantiles("iteration_seconds", "kind")[:2]),
        PanelDef("Request phases (p90)", "Engine queue, context phase (prefill) and generation phase (decode).", "s",
                 tuple((f"histogram_quantile(0.9, sum by (le) (rate({x(n)}_bucket{{{SEL}}}{R})))", label)
                       for n, label in (("request_queue_time_seconds", "queue"),
                                        ("request_prefill_time_seconds", "prefill"),
                                        ("request_decode_time_seconds", "decode")))),
    )),
    ("Ray Serve", (
        PanelDef("Replicas", "Healthy replicas per deployment (Ray Serve).", "short",
                 ((f"sum by (deployment) (ray_serve_deployment_replica_healthy{{{SERVE_SEL}}})", "{{deployment}}"),)),
        PanelDef("Serve queue", "Requests queued in Serve's handles and ongoing at the replicas.", "short",
                 ((f"sum by (deployment) (ray_serve_deployment_queued_queries{{{SERVE_SEL}}})",
                   "{{deployment}} queued"),
                  (f"sum by (deployment) (ray_serve_replica_processing_queries{{{SERVE_SEL}}})",
                   "{{deployment}} processing"))),
        PanelDef("Autoscaling target", "Replicas Serve's autoscaler aims at (the fixed count without autoscaling).",
                 "short", ((f"max by (deployment) (ray_serve_autoscaling_target_replicas{{{SERVE_SEL}}})",
                            "{{deployment}}"),)),
    )),
)


def panels() -> list[PanelDef]:
    return [p for _, row in ROWS for p in row]


def _variable(name: str, label: str, query: str) -> gd.QueryVariable:
    return (gd.QueryVariable(name).label(label).query(query).datasource(DataSourceRef("prometheus", "${datasource}"))
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True).all_value(".*"))


def build_dashboard() -> dict:
    """The dashboard as Grafana's JSON model (a dict; ``uid`` :data:`UID`)."""
    ds = DataSourceRef("prometheus", "${datasource}")
    running = x("num_requests_running")
    board = (gd.Dashboard(TITLE).uid(UID).tags(["rdserve", "llm", "speculative-decoding"]).refresh("30s")
             .time("now-1h", "now").timezone("browser").editable()
             .description("rdserve: OpenAI-compatible serving with ReDrafter speculative decoding (README, Observing)")
             .with_variable(gd.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
             .with_variable(_variable("model", "model", f"label_values({running}, model_name)"))
             .with_variable(_variable("app", "application",
                                      f'label_values({running}{{model_name=~"$model"}}, application)'))
             .with_variable(_variable("pool", "pool", f'label_values({running}{{model_name=~"$model"}}, deployment)')))
    for title, row in ROWS:
        board = board.with_row(gd.Row(title))
        for p in row:
            panel = (timeseries.Panel().title(p.title).description(p.description).unit(p.unit).datasource(ds)
                     .span(8).height(8))
            for ref, (expr, legend) in zip("ABCDEFGH", p.targets):
                panel = panel.with_target(prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref))
            board = board.with_panel(panel)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))
