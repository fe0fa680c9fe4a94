"""The replica side of metrics: turn engine counts and request timings into Ray metrics.

:class:`ReplicaMetrics` gives its engine an :class:`~workers.engine_metrics.EngineStats`, drains it
every ``RECORD_INTERVAL_S`` on the engine thread (``AsyncEngine.call``) and records counters,
histograms and gauges with Ray Serve's metrics API (``ray.serve.metrics``, which adds the
``application``/``deployment``/``replica`` labels); :class:`RequestMetrics` times one request from
the items the replica streams. Definitions: :mod:`cluster.observability.metrics`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from ray.serve import metrics as serve_metrics

from cluster.observability.metrics import METRICS, PREFIX, MetricDef, known_label_values, reason_label
from workers.outputs import GenerationDelta
from workers.engine_metrics import EngineStats, EngineStatsDelta

log = logging.getLogger("ray.serve")

RECORD_INTERVAL_S = 1.0
"""How often a replica drains its engine's counts and sets its gauges."""


def make_metric(spec: MetricDef, model_name: str):
    """A Ray Serve metric for ``spec`` with ``model_name`` as default tag."""
    kinds = {"counter": serve_metrics.Counter, "gauge": serve_metrics.Gauge, "histogram": serve_metrics.Histogram}
    extra = {"boundaries": list(spec.buckets)} if spec.buckets else {}
    metric = kinds[spec.kind](PREFIX + spec.name, description=spec.help, tag_keys=("model_name", *spec.labels),
                              **extra)
    metric.set_default_tags({"model_name": model_name})
    return metric


def start_at_zero(metric, spec: MetricDef, draft_len: int = 0) -> None:
    """Record the counter ``spec`` at zero for every combination of its known label values
    (:func:`~cluster.observability.metrics.known_label_values`), so its series exist from the replica's
    start: a panel over a rare event (preemptions, failures) shows 0 instead of "No data".

    Ray's ``Counter.inc`` refuses 0; ``_record`` is what it calls after that check.

    Raises:
        KeyError: a label of ``spec`` with no known values.
    """
    values = known_label_values(spec, draft_len)
    for combo in itertools.product(*values.values()):
        metric._record(0.0, tags=dict(zip(values, combo)))


class ReplicaMetrics:
    """Records one engine replica's metrics. ``async_engine``: the replica's ``AsyncEngine``.
    ``queued``: how many requests wait for the engine outside it (the in-process client's queue when
    the engine runs in the ingress, ``cluster.ingress.clients``); counted in ``num_requests_waiting``.
    ``draft_len``: the replica's draft_len_per_beam (0 without a drafter), the ``position`` values its
    counters start with. Every counter is recorded at zero here and every gauge set to 0, so their
    series exist before the first request."""

    def __init__(self, async_engine, model_name: str, draft_len: int = 0):
        self.async_engine = async_engine
        self.queued = lambda: 0
        self.m = {s.name: make_metric(s, model_name) for s in METRICS if s.where != "ingress"}
        for spec in METRICS:
            if spec.name in self.m and spec.kind == "counter":
                start_at_zero(self.m[spec.name], spec, draft_len)
            elif spec.name in self.m and spec.kind == "gauge":
                self.m[spec.name].set(0)
        async_engine.engine.stats = EngineStats()
        self._poller: asyncio.Task | None = None

    def request(self) -> RequestMetrics:
        """Timing of a request that arrived now; starts the periodic engine drain on first use (it
        needs the replica's event loop)."""
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())
        return RequestMetrics(self)

    async def _poll(self) -> None:
        engine = self.async_engine.engine
        while True:
            await asyncio.sleep(RECORD_INTERVAL_S)
            try:
                self.record_engine(await self.async_engine.call(engine.drain_stats))
            except Exception:  # a metrics problem must never stop serving; the next drain has the counts
                log.exception("recording engine metrics failed")

    def record_engine(self, d: EngineStatsDelta) -> None:
        m = self.m
        for name, value in (("prompt_tokens", d.prompt_tokens), ("generation_tokens", d.generation_tokens),
                            ("generation_steps", d.generation_steps), ("num_preemptions", d.num_preemptions),
                            ("spec_decode_num_drafts", d.drafts), ("spec_decode_num_draft_tokens", d.draft_tokens),
                            ("spec_decode_num_accepted_tokens", d.accepted_tokens),
                            ("spec_decode_num_grammar_rejected_tokens", d.grammar_rejected_tokens),
                            ("prefix_cache_queries", d.prefix_cache_queries), ("prefix_cache_hits", d.prefix_cache_hits)):
            if value:
                m[name].inc(value)
        if d.aborted:
            m["request_success"].inc(d.aborted, tags={"finished_reason": "abort"})
        for pos, count in enumerate(d.accepted_per_pos):
            if count:
                m["spec_decode_num_accepted_tokens_per_pos"].inc(count, tags={"position": str(pos)})
        for kind, seconds in d.iterations:
            m["iteration_seconds"].observe(seconds, tags={"kind": kind})
        for t in d.first_tokens:
            m["request_queue_time_seconds"].observe(t.queue_s)
            m["request_prefill_time_seconds"].observe(t.prefill_s)
        for t in d.finished:
            m["request_decode_time_seconds"].observe(t.decode_s)
        m["num_requests_running"].set(d.num_running)
        m["num_requests_waiting"].set(d.num_waiting + self.queued())
        m["kv_cache_usage_perc"].set(d.kv_cache_usage)
        m["spec_decode_num_beams"].set(d.spec_shape[0])
        m["spec_decode_draft_len_per_beam"].set(d.spec_shape[1])


class RequestMetrics:
    """Times one request from what the replica streams: ``Started`` (router decision), engine deltas
    (TTFT, inter-token latency; at the final one e2e latency, TPOT and ``request_success``)."""

    def __init__(self, owner: ReplicaMetrics):
        self.m = owner.m
        self.arrival = self.last = time.perf_counter()
        self.first: float | None = None

    def see(self, item) -> None:
        if not isinstance(item, GenerationDelta):
            if hasattr(item, "mode"):  # Started (a Failed is counted by the ingress)
                self.m["router_decisions"].inc(tags={"mode": item.mode, "reason": reason_label(item.reason)})
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.m["time_to_first_token_seconds"].observe(now - self.arrival)
        else:
            self.m["inter_token_latency_seconds"].observe(now - self.last)
        self.last = now
        if item.finished:
            self.m["e2e_request_latency_seconds"].observe(now - self.arrival)
            if item.completion_tokens > 1:
                self.m["request_time_per_output_token_seconds"].observe(
                    (now - self.first) / (item.completion_tokens - 1))
            self.m["request_success"].inc(tags={"finished_reason": item.finish_reason or "stop"})

