"""A real Prometheus (Debian's ``prometheus``) scrapes the session's Ray cluster while the tiny model
serves traffic; every dashboard panel's PromQL must return data through Prometheus's HTTP API, and the
alert rules must evaluate (two of them, given thresholds the traffic breaks, must fire). On a freshly
deployed application, every series a panel or a rule reads exists after start-up and one request."""

import asyncio
import math
import re
import socket
import subprocess
import time

import httpx
import pytest
import ray
from conftest import OBS_MODEL
from prom_tools import prometheus_binary
from ray import serve

from cluster.deploy.app import deploy
from cluster.observability.alerts import AlertThresholds, alert_rules, write_prometheus_files
from cluster.observability.dashboard import build_dashboard, panels
from cluster.observability.metrics import METRICS, known_label_values

VARIABLES = {"$model": OBS_MODEL, "$pool": ".*", "$app": "obs", "$__rate_interval": "2m"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus(obs_url, tmp_path_factory):
    """Prometheus scraping this node's Ray metrics agent every second; yields its base URL."""
    binary = prometheus_binary("prometheus")
    node = next(n for n in ray.nodes() if n["Alive"])
    root = tmp_path_factory.mktemp("prometheus")
    thresholds = AlertThresholds(ttft_p90_s=0.000001, min_acceptance_length=100.0, for_s=0)
    target = f"127.0.0.1:{node['MetricsExportPort']}"
    config, _ = write_prometheus_files(root, [target], thresholds, scrape_interval_s=1)
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=open(root / "prometheus.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, (root / "prometheus.log").read_text()
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("prometheus did not become ready within 60 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def send_traffic(obs_url: str, n: int = 8, max_tokens: int = 150) -> None:
    """``n`` concurrent requests (8 of 150 tokens: more than the 24-block KV cache holds, preemptions),
    speculative and plain, streamed and not, and one bad request (400)."""
    async with httpx.AsyncClient(base_url=obs_url, timeout=300) as client:
        async def one(i: int):
            body = {"model": OBS_MODEL, "prompt": f"Story {i}: it was a dark and stormy night and",
                    "max_tokens": max_tokens, "temperature": 0, "rdserve": {"mode": "spec" if i % 3 else "plain"},
                    "stream": i % 2 == 0}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text

        await asyncio.gather(*(one(i) for i in range(n)))
        bad = await client.post("/v1/completions", json={"model": OBS_MODEL, "prompt": "x", "temperature": -1})
        assert bad.status_code == 400


def query(url: str, expr: str) -> list:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200, (expr, r.text)
    return r.json()["data"]["result"]


def has_data(result: list) -> bool:
    return any(not math.isnan(float(s["value"][1])) for s in result)


SERIES = ["time_to_first_token_seconds_count", "request_time_per_output_token_seconds_count",
          "e2e_request_latency_seconds_count", "iteration_seconds_count", "request_decode_time_seconds_count",
          "spec_decode_num_accepted_tokens_total", "spec_decode_num_drafts_total", "router_decisions_total"]


def wait_for_series(url: str, names: list[str], timeout_s: float = 60) -> None:
    """Until Prometheus holds every ``ray_rdserve_<name>{model_name=OBS_MODEL}``: a series first scraped
    with its final value has no increase, so rate() over it is 0 (histogram quantiles NaN)."""
    deadline = time.monotonic() + timeout_s
    missing = names
    while missing and time.monotonic() < deadline:
        missing = [n for n in missing if not query(url, f'ray_rdserve_{n}{{model_name="{OBS_MODEL}"}}')]
        time.sleep(1)
    assert not missing, f"series not scraped within {timeout_s} s: {missing}"


def queried_series() -> set[str]:
    """Every series name (``ray_...``, a histogram's ``_bucket``/``_count`` as written) that the dashboard's
    JSON (panel targets, template variables) or an alert rule queries: a new panel or rule is covered
    without editing this test."""
    exprs = [r["expr"] for g in alert_rules()["groups"] for r in g["rules"]]

    def walk(node):
        if isinstance(node, dict):
            for key, val in node.items():
                if key in ("expr", "query") and isinstance(val, str):
                    exprs.append(val)
                else:
                    walk(val)
        elif isinstance(node, list):
            for val in node:
                walk(val)

    walk(build_dashboard())
    return {name for e in exprs for name in re.findall(r"\b(ray_[a-z0-9_]+)", e)}


FRESH_MODEL, FRESH_APP = "tiny-fresh", "fresh"


def test_every_queried_series_exists_after_start_and_one_request(prometheus, base_url, tiny_config):
    """A counter has no series until it is recorded: a panel over a rare event (preemptions) said "No data"
    on a healthy replica. Replicas record every counter at zero when they start, each known label value
    too, so after one request nothing a panel or a rule queries is missing."""
    names = queried_series()
    assert {"ray_rdserve_num_preemptions_total", "ray_rdserve_request_failure_total",
            "ray_serve_deployment_replica_healthy"} <= names  # the parse finds targets, variables and rules
    cfg = tiny_config.model_copy(update={"model": tiny_config.model.model_copy(update={"name": FRESH_MODEL})})
    deploy(cfg, name=FRESH_APP, route_prefix=f"/{FRESH_APP}")
    try:
        r = httpx.post(f"{base_url}/{FRESH_APP}/v1/completions", timeout=120,
                       json={"model": FRESH_MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text

        def selector(name: str) -> str:
            return f'{{model_name="{FRESH_MODEL}"}}' if name.startswith("ray_rdserve_") else \
                f'{{application="{FRESH_APP}"}}'

        missing = sorted(names)
        deadline = time.monotonic() + 60
        while missing and time.monotonic() < deadline:
            missing = [n for n in missing if not query(prometheus, n + selector(n))]
            if missing:
                time.sleep(1)
        assert not missing, f"queried by a panel or a rule, but no series after start-up and one request: {missing}"
        for m in METRICS:
            if m.kind != "counter" or not m.labels:
                continue
            for label, values in known_label_values(m, cfg.speculation.draft_len_per_beam).items():
                found = {s["metric"].get(label) for s in query(prometheus, m.exported + selector(m.exported))}
                assert set(values) <= found, (m.exported, label, sorted(set(values) - found))
    finally:
        serve.delete(FRESH_APP)


def test_every_dashboard_query_returns_data_and_alert_rules_evaluate(prometheus, obs_url):
    asyncio.run(send_traffic(obs_url, n=3, max_tokens=16))  # creates the series (if no earlier test did)
    wait_for_series(prometheus, SERIES)
    asyncio.run(send_traffic(obs_url))  # their increases
    exprs = {}
    for panel in panels():
        for expr, legend in panel.targets:
            for var, val in VARIABLES.items():
                expr = expr.replace(var, val)
            exprs[f"{panel.title} / {legend}"] = expr
    missing = dict(exprs)
    deadline = time.monotonic() + 90
    while missing and time.monotonic() < deadline:
        missing = {name: e for name, e in missing.items() if not has_data(query(prometheus, e))}
        if missing:
            time.sleep(2)
    assert not missing, f"panels without data after 90 s: {sorted(missing)}"

    rules = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"][0]["rules"]
    assert len(rules) == 5
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    firing = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and firing != {"RdserveTTFTSLOBreach", "RdserveSpecAcceptanceCollapse"}:
        alerts = httpx.get(f"{prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
        firing = {a["labels"]["alertname"] for a in alerts
                  if a["state"] == "firing" and a["labels"].get("model_name") == OBS_MODEL}
        time.sleep(1)
    assert firing == {"RdserveTTFTSLOBreach", "RdserveSpecAcceptanceCollapse"}
