"""The metric table, the router-reason labels and the dashboard's structure (no Ray)."""

import json
import re

import pytest
from typer.testing import CliRunner

from cluster.cli.main import app
from cluster.config import SpeculationConfig
from cluster.observability.dashboard import build_dashboard, panels
from cluster.observability.metrics import LABEL_VALUES, METRICS, ROUTER_REASONS, exported, reason_label
from cluster.observability.recorder import start_at_zero
from cluster.replica.spec_mode import choose_mode

SERVE_METRICS = {"ray_serve_deployment_replica_healthy", "ray_serve_deployment_queued_queries",
                 "ray_serve_replica_processing_queries", "ray_serve_autoscaling_target_replicas"}


def test_names_follow_vllm_with_our_prefix():
    assert exported("generation_tokens") == "ray_rdserve_generation_tokens_total"
    assert exported("time_to_first_token_seconds") == "ray_rdserve_time_to_first_token_seconds"
    assert len({m.name for m in METRICS}) == len(METRICS)
    for m in METRICS:
        assert re.fullmatch(r"[a-z0-9_]+", m.name) and not m.name.endswith("_total")
        assert (m.buckets is not None) == (m.kind == "histogram")
        if m.buckets:
            assert list(m.buckets) == sorted(set(m.buckets)) and m.name.endswith("_seconds")
    with pytest.raises(KeyError):
        exported("no_such_metric")


@pytest.mark.parametrize("requested,load,per_iteration,drafter,label", [
    ("spec", 1, False, True, "requested"), (None, 1, False, True, "auto_load"), (None, 99, False, True, "auto_load"),
    (None, 1, True, True, "auto_goodput"), ("plain", 1, False, False, "no_drafter"),
])
def test_every_router_reason_has_a_bounded_label(requested, load, per_iteration, drafter, label):
    _, reason = choose_mode(load, requested, SpeculationConfig(spec_max_load=4), drafter, per_iteration)
    assert reason_label(reason) == label
    _, reason = choose_mode(1, None, SpeculationConfig(default_mode="plain"), True)
    assert reason_label(reason) == "default_mode"
    _, reason = choose_mode(1, "spec", SpeculationConfig(), False, unavailable="speculation off (speculation.policy)")
    assert reason_label(reason) == "spec_off"


def test_dashboard_has_the_rows_variables_and_only_known_metrics(tmp_path):
    result = CliRunner().invoke(app, ["dashboards", "build", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    board = json.loads((tmp_path / "rdserve.json").read_text())
    assert board == build_dashboard() and board["uid"] == "rdserve"
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert rows == ["Traffic", "Latency", "Speculative decoding", "Engine", "Ray Serve"]
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "model", "app", "pool"]
    graphs = [p for p in board["panels"] if p["type"] == "timeseries"]
    assert len(graphs) == len(panels()) and all(p["datasource"]["uid"] == "${datasource}" for p in graphs)
    ours = {m.exported for m in METRICS}
    for panel in graphs:
        for target in panel["targets"]:
            names = set(re.findall(r"\b(ray_[a-z0-9_]+)", target["expr"]))
            names = {re.sub(r"_(bucket)$", "", n) for n in names}
            assert names and names <= ours | SERVE_METRICS, (panel["title"], names)


class FakeCounter:
    def __init__(self):
        self.records = []

    def _record(self, value, tags):
        self.records.append((value, tags))


def test_every_counter_starts_at_zero_with_each_known_label_value():
    """A counter without a series until its first increment made the dashboard's Preemptions/s say "No data"."""
    for m in (m for m in METRICS if m.kind == "counter"):
        counter = FakeCounter()
        start_at_zero(counter, m, draft_len=3)
        assert counter.records and {v for v, _ in counter.records} == {0.0}, m.name
        assert len({tuple(sorted(t.items())) for _, t in counter.records}) == len(counter.records)
        for label in m.labels:  # a new labelled counter needs its known values in LABEL_VALUES
            assert {t[label] for _, t in counter.records} == \
                ({"0", "1", "2"} if label == "position" else set(LABEL_VALUES[label])), (m.name, label)
    decisions = FakeCounter()
    start_at_zero(decisions, next(m for m in METRICS if m.name == "router_decisions"))
    assert len(decisions.records) == 2 * (len(ROUTER_REASONS) + 1)  # mode x reason, "other" included
    per_pos = FakeCounter()
    start_at_zero(per_pos, next(m for m in METRICS if m.name == "spec_decode_num_accepted_tokens_per_pos"))
    assert per_pos.records == []  # no drafter: no position is known
