"""Reading rdserve's series from Prometheus text (``GET /metrics``) in tests."""

import time
from collections import defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families

SETTLE_S = 2.5  # > the replica's record interval (1 s) + Ray's report interval in the tests (1 s)


def scrape(url: str, model: str) -> dict[tuple, float]:
    """``{(sample name, frozenset of labels other than model/Ray's): value}`` summed over replicas."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[tuple, float] = defaultdict(float)
    skip = {"model_name", "Component", "NodeAddress", "SessionName", "Version", "WorkerId", "application",
            "deployment", "replica", "otel_scope_name", "otel_scope_schema_url", "otel_scope_version"}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model_name") == model:
                out[(s.name, frozenset((k, v) for k, v in s.labels.items() if k not in skip))] += s.value
    return dict(out)


def value(snapshot: dict, name: str, **labels) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    want = {(k, str(v)) for k, v in labels.items()}
    return sum(v for (n, ls), v in snapshot.items() if n == name and want <= ls)


def settled(url: str, model: str, done=lambda snap: True, timeout_s: float = 60.0) -> dict:
    """Poll until ``done(snapshot)`` and two snapshots ``SETTLE_S`` apart are equal; return the last.

    Raises:
        AssertionError: not settled within ``timeout_s`` (the message shows the last snapshot).
    """
    deadline = time.monotonic() + timeout_s
    previous = None
    while time.monotonic() < deadline:
        snap = scrape(url, model)
        if done(snap) and snap == previous:
            return snap
        previous = snap if done(snap) else None
        time.sleep(SETTLE_S)
    raise AssertionError(f"metrics did not settle within {timeout_s} s; last: {sorted(previous or snap)}")
