"""Metric definitions (vLLM ``bench serve``) on hand-made records."""

from types import SimpleNamespace

import pytest

from cluster.evaluation.metrics import Slo, distribution_ms, meets_slo, summarize, tpot_s


def rec(ttft_s, latency_s, tokens, itl_s=(), ok=True, rdserve=None):
    return SimpleNamespace(ok=ok, ttft_s=ttft_s, latency_s=latency_s, output_tokens=tokens, itl_s=list(itl_s),
                           rdserve=rdserve)


def test_tpot_excludes_first_token_and_is_undefined_for_one_token():
    assert tpot_s(1.0, 0.2, 5) == pytest.approx(0.2)
    assert tpot_s(1.0, 0.2, 1) is None and tpot_s(1.0, None, 5) is None


def test_distribution_in_ms_with_percentiles():
    d = distribution_ms([0.001 * v for v in range(1, 101)])
    assert d["n"] == 100 and d["mean"] == pytest.approx(50.5)
    assert d["p50"] == pytest.approx(50.5) and d["p99"] == pytest.approx(99.01)
    assert distribution_ms([])["p90"] is None


def test_goodput_counts_requests_meeting_all_slos():
    slo = Slo(ttft_ms=300, tpot_ms=100)
    assert meets_slo(0.2, 0.05, 1.0, slo) and not meets_slo(0.4, 0.05, 1.0, slo)
    assert not meets_slo(0.2, 0.2, 1.0, slo) and not meets_slo(0.2, 0.05, 1.0, Slo(e2e_ms=500))
    records = [rec(0.2, 0.6, 5, [0.1] * 4), rec(0.5, 0.9, 5), rec(0.1, 0.2, 2), rec(None, 0.0, 0, ok=False)]
    s = summarize(records, duration_s=2.0, slo=slo)
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["goodput"] == pytest.approx(2 / 2.0)  # the second misses TTFT
    assert s["request_throughput"] == pytest.approx(1.5) and s["output_throughput"] == pytest.approx(6.0)
    assert s["itl_ms"]["n"] == 4 and s["tokens_per_step"] is None and summarize(records, 2.0)["goodput"] is None


def test_tokens_per_step_pools_steps_and_accepted_tokens():
    stats = [{"mode": "spec", "num_steps": 4, "accepted_draft_tokens": 4},
             {"mode": "plain", "num_steps": 4, "accepted_draft_tokens": 0}]
    s = summarize([rec(0.1, 1.0, 9, rdserve=st) for st in stats], 1.0)
    assert s["tokens_per_step"] == pytest.approx(12 / 8) and s["modes"] == {"spec": 1, "plain": 1}
