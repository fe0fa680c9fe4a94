"""The load generator's figures against a synthetic server with known delays (no Ray, no model)."""

import time

import pytest
from synthetic_server import Delays, SyntheticServer

from cluster.evaluation.loadgen import LoadSpec, run_load
from cluster.evaluation.metrics import Slo
from cluster.evaluation.prompts import PromptRow

PROMPTS = [PromptRow(category="a", prompt="x"), PromptRow(category="b", prompt="y")]
DELAYS = Delays(first_s=0.10, gap_s=0.05, chunks=5)
EXPECTED_LATENCY_S = DELAYS.first_s + (DELAYS.chunks - 1) * DELAYS.gap_s  # 0.30
REL = 0.4  # scheduler noise on a loaded 2-core machine


@pytest.fixture(scope="module")
def url():
    with SyntheticServer(DELAYS) as base_url:
        yield base_url


def test_closed_loop_figures_match_known_delays(url):
    spec = LoadSpec(model="m", max_tokens=5, mode="spec", concurrency=2, max_requests=6, duration_s=30)
    run = run_load(url, PROMPTS, spec, count_tokens=lambda text: len(text.split()), progress=False)
    s = run.summary(Slo(ttft_ms=1000, tpot_ms=1000))

    assert s["completed"] == 6 and s["failed"] == 0
    assert [r.category for r in run.records] == ["a", "b"] * 3
    assert all(r.output_tokens == DELAYS.chunks and r.rdserve["mode"] == "spec" for r in run.records)
    assert s["ttft_ms"]["p50"] == pytest.approx(DELAYS.first_s * 1e3, rel=REL)
    assert s["itl_ms"]["p50"] == pytest.approx(DELAYS.gap_s * 1e3, rel=REL)
    assert s["itl_ms"]["n"] == 6 * (DELAYS.chunks - 1)
    assert s["tpot_ms"]["mean"] == pytest.approx(DELAYS.gap_s * 1e3, rel=REL)
    assert s["e2e_latency_ms"]["p50"] == pytest.approx(EXPECTED_LATENCY_S * 1e3, rel=REL)
    # two clients, three rounds of one request each
    assert s["request_throughput"] == pytest.approx(2 / EXPECTED_LATENCY_S, rel=REL)
    assert s["output_throughput"] == pytest.approx(s["request_throughput"] * DELAYS.chunks)
    assert s["goodput"] == pytest.approx(s["request_throughput"])
    assert run.summary(Slo(ttft_ms=1.0))["goodput"] == 0.0


def test_tokens_from_usage_without_tokenizer(url):
    run = run_load(url, PROMPTS, LoadSpec(model="m", concurrency=1, max_requests=2), progress=False)
    assert [r.output_tokens for r in run.records] == [DELAYS.chunks] * 2
    assert all(r.usage["completion_tokens"] == DELAYS.chunks for r in run.records)


def test_open_loop_poisson_rate(url):
    spec = LoadSpec(model="m", concurrency=None, rate=20.0, max_requests=10, duration_s=30, seed=3)
    run = run_load(url, PROMPTS, spec, progress=False)
    starts = [r.start_s for r in run.records]
    assert run.summary()["completed"] == 10
    assert starts == sorted(starts) and starts[-1] < 10 / 20.0 * 4  # mean gap 50 ms
    # requests overlap: the run is much shorter than 10 sequential requests
    assert run.duration_s < starts[-1] + EXPECTED_LATENCY_S * (1 + REL) + 0.5


def test_run_stops_within_its_time_bound():
    slow = Delays(first_s=0.05, gap_s=0.5, chunks=40)  # 20 s per request
    with SyntheticServer(slow) as slow_url:
        spec = LoadSpec(model="m", concurrency=2, max_requests=100, duration_s=0.5, grace_s=0.5)
        t0 = time.perf_counter()
        run = run_load(slow_url, PROMPTS, spec, progress=False)
        elapsed = time.perf_counter() - t0
    assert elapsed < spec.duration_s + spec.grace_s + 1.5
    assert len(run.records) == 2 and not any(r.ok for r in run.records)
    assert all("time limit" in r.error for r in run.records)


def test_spec_needs_exactly_one_arrival_pattern():
    with pytest.raises(ValueError, match="exactly one"):
        LoadSpec(model="m", concurrency=2, rate=1.0)
