"""``rdserve eval``, every step, against the shared tiny-model Ray Serve cluster (tests/cluster/conftest.py)."""

import json

from typer.testing import CliRunner

from cluster.cli.main import app

PROMPTS = [
    {"prompt": "Once upon a time", "category": "story"},
    {"messages": [{"role": "user", "content": "Reply in JSON."}], "category": "json"},
    {"prompt": "2 + 3 =", "category": "math", "reference": "#### 5"},
    {"prompt": "def f(x):", "category": "code", "stop": ["\n\n"]},
]


def test_eval_all_steps_on_the_tiny_cluster(base_url, tiny_config_path, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    out = tmp_path / "report"
    args = ["eval", "--config", str(tiny_config_path), "--prompts", str(prompts), "--url", base_url,
            "--out", str(out), "--max-tokens", "8", "--levels", "1,2", "--requests-per-level", "4",
            "--rate", "20", "--shapes", "1x2,2x3", "--samples", "1", "--slo-ttft-ms", "5000", "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output

    res = json.loads((out / "results.json").read_text())
    assert res["baseline"]["summary"]["completed"] == 4 and res["baseline"]["summary"]["modes"] == {"plain": 4}
    assert res["baseline"]["summary"]["ttft_ms"]["p50"] > 0
    compat = res["compatibility"]
    assert compat["tp_size"] == 1 and compat["redrafter"]["num_beams"] == 2 and compat["versions"]["torch"]
    assert compat["server"]["speculative_available"]

    shapes = res["acceptance"]["shapes"]
    assert [(s["num_beams"], s["draft_len_per_beam"]) for s in shapes] == [(1, 2), (2, 3)]
    for shape in shapes:
        assert set(shape["by_category"]) == {"story", "json", "math", "code", "all"}
        figures = shape["by_category"]["all"]
        assert figures["tokens_per_step"] >= 1.0
        assert len(figures["acceptance_rate_by_position"]) == shape["draft_len_per_beam"]

    quality = res["quality"]
    assert quality["greedy"]["passed"] and quality["greedy"]["mismatches"] == []  # float32: lossless
    assert quality["greedy"]["logprobs"]["compared_tokens"] > 0 and quality["greedy"]["logprobs"]["max_abs_diff"] == 0
    assert set(quality["task_checks"]) == {"valid_json", "final_number", "code_parses"}
    assert quality["finish_reason_differs"] == [] and quality["stop_string_leaks"] == []
    assert 0.0 <= quality["sampled"]["tv_spec_vs_plain"] <= 1.0

    staged = res["staged_load"]
    assert staged["levels"] == [1, 2] and set(staged["closed_loop"]) == {"spec", "plain", "auto"}
    assert all(s["completed"] == 4 for runs in staged["closed_loop"].values() for s in runs)
    assert staged["closed_loop"]["plain"][0]["modes"] == {"plain": 4}
    assert staged["closed_loop"]["spec"][0]["modes"] == {"spec": 4}
    assert set(staged["open_loop"]["by_mode"]) == {"spec", "plain", "auto"}
    decision = staged["decision"]
    assert decision["speculation_yaml"] == f"speculation:\n  spec_max_load: {decision['spec_max_load']}\n"
    assert (out / "speculation.yaml").read_text() == decision["speculation_yaml"]

    report = (out / "report.md").read_text()
    headings = ("1. Baseline", "2. Compatibility", "3. Acceptance", "4. Quality", "5. Staged load", "spec_max_load")
    for heading in headings:
        assert heading in report
    assert (out / "acceptance.png").stat().st_size > 0 and (out / "load.png").stat().st_size > 0


def test_eval_single_step_accumulates_and_unsupported_config_fails(base_url, tiny_config_path, tmp_path):
    bad = tiny_config_path.parent / "bad_tp.yaml"
    bad.write_text(tiny_config_path.read_text().replace("num_threads: 1", "num_threads: 1, tp_size: 3"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(PROMPTS[0]) + "\n")
    result = CliRunner().invoke(app, ["eval", "--config", str(bad), "--prompts", str(prompts), "--url", base_url,
                                      "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "engine.tp_size" in result.output
