"""The report renders from a results dict: Markdown, JSON and PNGs; step policies as plain functions."""

import json

from pathlib import Path

import pytest

from cluster.evaluation.acceptance import StepDraft, acceptance_figures, parse_shapes, steps_from_deltas
from cluster.evaluation.quality import first_mismatch, greedy_verdict, total_variation
from cluster.evaluation.report import write_report
from cluster.evaluation.staged_load import decide
from cluster.evaluation.task_checks import code_parses, final_number, json_is_valid, math_is_correct, task_check


def summary(tput, tpot_ms):
    dist = {"mean": tpot_ms, "p50": tpot_ms, "p90": tpot_ms, "p99": tpot_ms, "n": 4}
    return {"completed": 4, "failed": 0, "duration_s": 1.0, "output_tokens": 40, "request_throughput": 4.0,
            "output_throughput": tput, "goodput": 3.0, "slo": None, "ttft_ms": dist, "tpot_ms": dist,
            "itl_ms": dist, "e2e_latency_ms": dist, "tokens_per_step": 2.0, "modes": {}}


def test_decision_crossover_and_speculation_yaml():
    levels = [1, 2, 4, 8]
    spec = [summary(100, 10), summary(150, 12), summary(150, 30), summary(300, 5)]
    plain = [summary(50, 20), summary(100, 20), summary(200, 20), summary(200, 20)]
    d = decide(levels, spec, plain, replicas=2)
    assert d["pays_by_level"] == {"1": True, "2": True, "4": False, "8": True}
    assert d["crossover_concurrency"] == 2 and d["spec_max_load"] == 1
    assert d["speculation_yaml"] == "speculation:\n  spec_max_load: 1\n"
    import yaml

    from cluster.config import parse_config

    assert parse_config(yaml.safe_load(d["speculation_yaml"]), Path(".")).speculation.spec_max_load == 1  # pastes in
    assert decide([1], [summary(10, 30)], [summary(20, 20)])["spec_max_load"] == 0


def test_acceptance_per_position_from_cumulative_counts():
    # budget 8, draft_len 3: accept 3 (drafted 3), accept 1 (only 2 could be drafted), then one plain step
    steps = steps_from_deltas([3, 4, 4], draft_len_per_beam=3, budget=8)
    assert steps == [StepDraft(3, 3), StepDraft(2, 1)]
    f = acceptance_figures(steps, num_generation_steps=3, num_beams=2, draft_len_per_beam=3)
    assert f["tokens_per_step"] == pytest.approx((4 + 3) / 3)
    assert f["acceptance_rate_by_position"] == [1.0, 0.5, 1.0]
    assert f["drafted_per_accepted"] == pytest.approx(2 * 5 / 4)
    assert parse_shapes("1x2, 4x4") == [(1, 2), (4, 4)]
    with pytest.raises(ValueError, match="NUM_BEAMSxDRAFT_LEN"):
        parse_shapes("4-4")


def test_quality_policies_and_task_checks():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None and first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2
    assert greedy_verdict([], "float32", 0.1) and not greedy_verdict([{"gap": 0.01}], "float32", 0.1)
    assert greedy_verdict([{"gap": 0.01}], "bfloat16", 0.1) and not greedy_verdict([{"gap": 0.5}], "bfloat16", 0.1)
    from collections import Counter
    assert total_variation(Counter("aabb"), Counter("abab")) == 0 and total_variation(Counter("a"), Counter("b")) == 1
    assert json_is_valid('Sure: ```json\n{"a": 1}\n```') and json_is_valid('x {"a": [1]} y') and not json_is_valid("{a")
    assert final_number("so 1,234.5 apples") == 1234.5 and math_is_correct("answer: 72", "... #### 72")
    assert math_is_correct("answer: 7", "#### 72") is False
    assert code_parses("```python\ndef f(x):\n    return x\n```") and not code_parses("def f(:")
    assert task_check("math", "3", None) is None and task_check("chat", "x", None) is None
    assert task_check("json-extraction", "{}", None) == ("valid_json", True)


def test_report_renders_from_results(tmp_path):
    s = summary(100, 10)
    results = {
        "meta": {"url": "http://x", "model": "m", "config": "c.yaml", "prompts": "p.jsonl"},
        "baseline": {"settings": {"max_tokens": 8}, "summary": s},
        "compatibility": {"error": "engine.tp_size: only 1 is supported"},
        "acceptance": {"max_tokens": 8, "temperature": 0.0, "shapes": [
            {"num_beams": n, "draft_len_per_beam": 2, "by_category": {
                "math": {"tokens_per_step": 1.5 * n, "acceptance_rate_by_position": [0.5, None],
                         "drafted_per_accepted": 4.0}}} for n in (1, 2)]},
        "quality": {"greedy": {"compared": 2, "dtype": "bfloat16", "tolerance": 0.1, "passed": True,
                               "mismatches": [{"prompt_index": 1, "category": "math", "prompt": "2+2", "position": 3,
                                               "plain_token": 7, "spec_token": 9, "gap": 0.02}]},
                    "task_checks": {"final_number": {"n": 2, "plain": 1, "spec": 1}},
                    "finish_reason_differs": [], "stop_string_leaks": [],
                    "sampled": {"samples_per_prompt": 2, "tv_spec_vs_plain": 0.1, "tv_plain_vs_plain": 0.08,
                                "within_noise": True}},
        "staged_load": {"levels": [1, 2], "slo": None, "closed_loop": {"spec": [s, s], "plain": [s, s]},
                        "open_loop": {"rate": 2.0, "by_mode": {"spec": s}},
                        "decision": decide([1, 2], [s, s], [s, s])},
    }
    paths = write_report(results, tmp_path)
    md = paths["markdown"].read_text()
    assert "TPOT" in md and "(E2E latency - TTFT) / (output tokens - 1)" in md
    assert "**Unsupported:** engine.tp_size" in md and "prompt 1 (math) at token 3" in md and "gap 0.0200" in md
    assert "| 2x2 | math | 3.00 | 0.50, - | 4.00 |" in md and "spec rate=2/s" in md
    assert "spec_max_load: 2" in md and (tmp_path / "speculation.yaml").read_text() == "speculation:\n  spec_max_load: 2\n"
    assert json.loads(paths["json"].read_text())["baseline"]["summary"]["output_throughput"] == 100
    for png in ("acceptance_png", "load_png"):
        assert paths[png].read_bytes()[:4] == b"\x89PNG"


def test_a_results_file_of_an_earlier_version_still_renders(tmp_path):
    """``rdserve eval`` adds steps to an existing ``results.json``; one written before the speculation
    section held the decision's snippet under another key, and the report rendered it from there."""
    from cluster.evaluation.report import write_report

    s = summary(100, 10)
    results = {"staged_load": {"levels": [1], "slo": None, "closed_loop": {"spec": [s], "plain": [s]},
                               "decision": {"pays_by_level": {"1": True}, "crossover_concurrency": 1,
                                            "spec_max_load": 1, "router_yaml": "router:\n  spec_max_load: 1\n"}}}
    paths = write_report(results, tmp_path)
    assert paths["speculation_yaml"].read_text() == "speculation:\n  spec_max_load: 1\n"
    assert "speculation:\n  spec_max_load: 1" in paths["markdown"].read_text()


def test_compatibility_names_the_servers_compute_path_and_what_the_shape_means_under_auto(tmp_path):
    compat = {"backend": "torch", "device": "cpu", "dtype": "float32", "tp_size": 1, "max_seq_len": 2048,
              "replicas": 1, "redrafter": {"drafter": "d", "num_beams": 2, "draft_len_per_beam": 2},
              "speculation": {"policy": "auto", "spec_max_load": 2, "default_mode": "auto"},
              "features": {}, "versions": {}, "server": {"compute_path": "gguf-avx512-int8"}}
    md = write_report({"compatibility": compat}, tmp_path / "a")["markdown"].read_text()
    assert "- backend `torch` on `cpu`, compute path `gguf-avx512-int8` (the server's kernels" in md
    assert "2 beams x 2 draft tokens per beam for requests that force speculation (under policy auto" in md
    fixed = {**compat, "server": None, "speculation": {**compat["speculation"], "policy": "fixed"}}
    md = write_report({"compatibility": fixed}, tmp_path / "b")["markdown"].read_text()
    assert "- backend `torch` on `cpu`, dtype `float32`, tp_size 1" in md  # no server asked: no path named
    assert "2 beams x 2 draft tokens per beam (drafter `d`)" in md
