"""``cluster.routing.autoscaling``: the replica-count rule as a plain function, its Serve adapter, and its wiring."""

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from cluster.deploy.app import replacement_options, replica_count_options
from cluster.routing.autoscaling import RdserveAutoscalingPolicy, ScalingSettings, desired_replicas, stats_by_replica
from cluster.config import parse_config

SETTINGS = ScalingSettings(target_ongoing_requests=8, kv_usage_target=0.85, slo_ttft_s=0.5)


def replica(load=0.0, waiting=0.0, kv_usage=0.1, ttft_p90_s=None) -> dict:
    stats = {"load": load, "running": load - waiting, "waiting": waiting, "kv_usage": kv_usage}
    return stats if ttft_p90_s is None else {**stats, "ttft_p90_s": ttft_p90_s}


@pytest.mark.parametrize("loads, current, expected", [
    ([16, 16], 2, 4),          # 32 requests / 8 per replica
    ([8.0], 1, 1),             # exactly at target
    ([8.5], 1, 2),             # just above target
    ([16.0000001], 1, 2),      # float noise of the time-weighted mean does not add a replica
    ([3, 2], 2, 1),            # light load: one replica is enough
    ([0, 0], 2, 1),            # idle: never below 1
    ([0.2], 1, 1),             # one request's worth is one replica
])
def test_demand_is_total_load_over_target(loads, current, expected):
    assert desired_replicas(current, [replica(load) for load in loads], SETTINGS) == expected


def test_requests_queued_in_serve_count_as_demand():
    assert desired_replicas(1, [replica(8)], SETTINGS, queued=9) == 3  # (8 + 9) / 8


def test_hold_when_no_replica_has_reported():
    assert desired_replicas(3, [], SETTINGS) == 3
    assert desired_replicas(2, [{"kv_usage": 0.9}], SETTINGS) == 2  # a report without load is no measurement


def test_a_replica_without_a_report_counts_as_no_load():
    assert desired_replicas(2, [replica(12)], SETTINGS) == 2


@pytest.mark.parametrize("stats, expected, why", [
    ([replica(6, waiting=3, kv_usage=0.9)], 2, "waiting and KV cache nearly full"),
    ([replica(6, waiting=3, kv_usage=0.5, ttft_p90_s=0.8)], 2, "waiting and TTFT p90 above the SLO"),
    ([replica(6, waiting=3, kv_usage=0.5, ttft_p90_s=0.3)], 1, "waiting, but KV and TTFT are fine"),
    ([replica(6, waiting=0.5, kv_usage=0.95, ttft_p90_s=2.0)], 1, "KV full and slow, but nothing waits"),
    ([replica(6, waiting=3, kv_usage=0.9), replica(1, kv_usage=0.2)], 1, "mean KV 0.55: demand 7 / 8 alone"),
])
def test_pressure_adds_a_replica(stats, expected, why):
    assert desired_replicas(len(stats), stats, SETTINGS) == expected, why


def test_pressure_asks_one_more_than_the_current_count_even_when_demand_is_lower():
    stats = [replica(4, waiting=2, kv_usage=0.95), replica(4, waiting=2, kv_usage=0.95)]
    assert desired_replicas(2, stats, SETTINGS) == 3  # demand alone says 1
    assert desired_replicas(2, [replica(40, waiting=20, kv_usage=0.95)] * 2, SETTINGS) == 10  # demand wins


def test_no_slo_means_ttft_is_ignored():
    settings = ScalingSettings(target_ongoing_requests=8)
    assert desired_replicas(1, [replica(6, waiting=3, kv_usage=0.5, ttft_p90_s=9.0)], settings) == 1


def test_stats_by_replica_transposes_serves_metrics():
    metrics = {"load": {"a": 3.0, "b": 1.0}, "kv_usage": {"a": 0.5}}
    assert sorted(stats_by_replica(metrics), key=lambda s: s["load"]) == [
        {"load": 1.0}, {"load": 3.0, "kv_usage": 0.5}]
    assert stats_by_replica(None) == []


def context(target: int, metrics: dict, queued: float = 0.0, upscale_delay_s: float = 0.0) -> AutoscalingContext:
    dep = DeploymentID(name="EngineReplica", app_name="rdserve")
    running = [ReplicaID(unique_id=rid, deployment_id=dep) for rid in sorted({r for v in metrics.values() for r in v})]
    by_id = {r.unique_id: r for r in running}
    aggregated = {name: {by_id[rid]: v for rid, v in values.items()} for name, values in metrics.items()}
    config = AutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=upscale_delay_s, downscale_delay_s=0)
    return AutoscalingContext(
        deployment_id=dep, deployment_name=dep.name, app_name=dep.app_name, current_num_replicas=len(running),
        target_num_replicas=target, running_replicas=running, total_num_requests=lambda: 0.0,
        total_queued_requests=lambda: queued, aggregated_metrics=lambda: aggregated, raw_metrics=None,
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=None, config=config,
    )


def test_serve_adapter_reads_the_context():
    policy = RdserveAutoscalingPolicy(target_ongoing_requests=8, kv_usage_target=0.85, slo_ttft_s=None)
    ctx = context(2, {"load": {"a": 10.0, "b": 9.0}, "waiting": {"a": 0.0, "b": 0.0}}, queued=5)
    assert policy(ctx) == (3, {})  # (19 + 5) / 8
    assert policy(context(2, {})) == (2, {})  # nothing reported: hold the target


def test_serve_applies_its_delays_after_the_policy():
    """Through Serve's own wrapper: with a 10 s upscale delay the first decision holds the target."""
    policy = _apply_autoscaling_config(RdserveAutoscalingPolicy(target_ongoing_requests=8))
    decision, state = policy(context(1, {"load": {"a": 20.0}}, upscale_delay_s=10))
    assert decision == 1 and state  # Serve's delay counters live in the returned policy state
    assert policy(context(1, {"load": {"a": 20.0}}))[0] == 3  # 20 / 8, no delay


def cfg_with(serve: dict, engine: dict | None = None):
    return parse_config({"serve": serve, "engine": {"num_threads": 2, **(engine or {})}}, base_dir=".")


def test_fixed_replicas_keep_todays_options():
    cfg = cfg_with({"replicas": 3})
    assert replica_count_options(cfg) == {"num_replicas": 3}
    assert replacement_options(cfg) == {"graceful_shutdown_timeout_s": 30.0, "graceful_shutdown_wait_loop_s": 1.0}


def test_autoscaling_options_carry_bounds_delays_policy_and_graceful_shutdown():
    cfg = cfg_with({"autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4,
                                    "upscale_delay_s": 1, "downscale_delay_s": 5, "look_back_period_s": 3,
                                    "metrics_interval_s": 0.5, "slo_ttft_ms": 800, "graceful_shutdown_timeout_s": 900}})
    options = replica_count_options(cfg)
    assert "num_replicas" not in options
    config = AutoscalingConfig(**options["autoscaling_config"])  # what Serve validates
    assert (config.min_replicas, config.max_replicas, config.target_ongoing_requests) == (1, 3, 4)
    assert (config.upscale_delay_s, config.downscale_delay_s, config.look_back_period_s) == (1, 5, 3)
    assert config.metrics_interval_s == 0.5
    assert config.policy.policy_function == "cluster.routing.autoscaling:RdserveAutoscalingPolicy"
    assert config.policy.policy_kwargs == {"target_ongoing_requests": 4, "kv_usage_target": 0.85, "slo_ttft_s": 0.8}
    policy = config.policy.get_policy()(**config.policy.policy_kwargs)  # as Serve's controller builds it
    assert policy.settings == ScalingSettings(target_ongoing_requests=4, kv_usage_target=0.85, slo_ttft_s=0.8)
    replacement = replacement_options(cfg)
    assert (replacement["graceful_shutdown_timeout_s"], replacement["max_surge_percent"]) == (900, 100)


def test_without_num_threads_the_cores_are_shared_by_the_most_replicas(monkeypatch):
    from cluster.replica.build import num_threads

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert num_threads(cfg_with({"replicas": 2}, {"num_threads": None})) == 4
    assert num_threads(cfg_with({"replicas": 1, "autoscaling": {"max_replicas": 4}}, {"num_threads": None})) == 2
    assert num_threads(cfg_with({"autoscaling": {"max_replicas": 4}}, {"num_threads": 3})) == 3
