"""``cluster.ingress.serve_state``: replica counts per pool from Serve's instance details, and the timeout."""

import asyncio
import time

from cluster.ingress import serve_state
from cluster.ingress.serve_state import pool_counts, replica_counts


def details(*replica_states: str, target: int = 2) -> dict:
    """The part of ``get_serve_instance_details`` that ``pool_counts`` reads (states are str enums there)."""
    replicas = [{"replica_id": f"r{i}", "state": s} for i, s in enumerate(replica_states)]
    return {"applications": {"rdserve": {"deployments": {
        "EngineReplica": {"target_num_replicas": target, "replicas": replicas},
        "OpenAIIngress": {"target_num_replicas": 1, "replicas": [{"replica_id": "i", "state": "RUNNING"}]},
    }}}}


def test_counts_replicas_by_state_per_pool():
    counts = pool_counts(details("RUNNING", "STARTING", "RUNNING", "STOPPING", target=3), "rdserve",
                         {"engine": "EngineReplica"})
    assert counts == {"engine": {"running": 2, "starting": 1, "stopping": 1, "target": 3}}


def test_unknown_app_or_deployment_counts_zero():
    zero = {"running": 0, "starting": 0, "stopping": 0, "target": 0}
    assert pool_counts(details("RUNNING"), "other", {"engine": "EngineReplica"}) == {"engine": zero}
    assert pool_counts(details("RUNNING"), "rdserve", {"engine": "EngineReplica", "plain": "PlainReplica"}) == {
        "engine": {**zero, "running": 1, "target": 2}, "plain": zero}


class SlowController:
    class get_serve_instance_details:  # noqa: N801 - mimics an actor method
        @staticmethod
        def remote():
            return asyncio.sleep(10)


def test_a_controller_that_does_not_answer_gives_none_within_the_timeout(monkeypatch):
    monkeypatch.setattr(serve_state, "_controller", SlowController)
    start = time.monotonic()
    assert asyncio.run(replica_counts("rdserve", {"engine": "EngineReplica"}, timeout_s=0.2)) is None
    assert time.monotonic() - start < 2
