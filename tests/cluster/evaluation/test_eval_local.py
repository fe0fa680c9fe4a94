"""The commands a user runs, as they run them: ``rdserve up`` and then ``rdserve eval --config
configs/local.yaml`` (every step, a short prompt set) on the shipped default preset and the real default
model (SmolLM2-135M-Instruct, ``rdserve model pull``), so a default that breaks ``rdserve eval`` fails CI.

The server runs the shipped preset as it is, on free ports: a copy of ``configs/local.yaml`` with only
``serve.port`` and ``observability.metrics_port`` changed, in a folder that mirrors the project (every
other entry a symlink), so the preset's relative paths resolve to the same files. ``rdserve eval`` reads
``configs/local.yaml`` itself and is pointed at that server with ``--url``. About 2 min on 2 cores.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from ray_cluster import free_ports, read_all, start_rdserve_up, stop_process_group

from cluster.config import load_config
from cluster.evaluation.eval_cli import STEPS, default_shapes

REPO = Path(__file__).resolve().parents[3]
LOCAL = REPO / "configs" / "local.yaml"
EVAL_TIMEOUT_S = 600
PROMPTS = [
    {"prompt": "The capital of France is", "category": "general"},
    {"messages": [{"role": "user", "content": "Give a JSON object with keys name and age."}], "category": "json"},
    {"messages": [{"role": "user", "content": "What is 2 + 3? End with #### and the number."}], "category": "math",
     "reference": "#### 5"},
    {"prompt": "def add(a, b):", "category": "code", "stop": ["\n\n"]},
]


def local_preset_on_free_ports(root: Path) -> Path:
    """``configs/local.yaml`` under ``root`` (a mirror of the project) with free serve and metrics ports."""
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name != "configs":
            (root / entry.name).symlink_to(entry)
    (root / "configs").mkdir()
    for entry in (REPO / "configs").iterdir():
        if entry != LOCAL:
            (root / "configs" / entry.name).symlink_to(entry)
    data = yaml.safe_load(LOCAL.read_text())
    port, metrics_port = free_ports(2)
    data.setdefault("serve", {})["port"] = port
    data.setdefault("observability", {})["metrics_port"] = metrics_port
    config = root / "configs" / "local.yaml"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    return config


@pytest.mark.slow
def test_eval_every_step_on_the_shipped_local_config(tmp_path):
    from workers.models.pull import pull_default

    pull_default()  # `rdserve model pull` (a no-op once cached), before the server's clock starts
    served = local_preset_on_free_ports(tmp_path / "project")
    assert load_config(served).model_dump(exclude={"serve", "observability"}) == \
        load_config(LOCAL).model_dump(exclude={"serve", "observability"})  # the same preset but for its ports
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "report"
    ray_dir = Path(tempfile.mkdtemp(prefix="rdev-", dir="/tmp"))  # short: Ray's socket paths are length-limited
    try:
        proc, up_log = start_rdserve_up(served, ray_dir, cwd=REPO)
    except RuntimeError as err:
        pytest.fail(str(err))
    try:
        cmd = [str(Path(sys.executable).with_name("rdserve")), "eval", "--config", str(LOCAL),
               "--prompts", str(prompts), "--url", f"http://127.0.0.1:{load_config(served).serve.port}",
               "--out", str(out), "--max-tokens", "8", "--levels", "1,2", "--requests-per-level", "2",
               "--rate", "20", "--samples", "2", "--slo-ttft-ms", "10000", "--no-progress"]
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=EVAL_TIMEOUT_S,
                                env={**os.environ, "COLUMNS": "200"})
    finally:
        stop_process_group(proc)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}\nserver:\n{read_all(up_log)[-2000:]}"
    assert "wrote " in result.stdout

    cfg = load_config(LOCAL)
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["steps"] == list(STEPS) and res["meta"]["model"] == cfg.model.name
    n, categories = len(PROMPTS), {p["category"] for p in PROMPTS} | {"all"}

    baseline = res["baseline"]["summary"]
    assert (baseline["completed"], baseline["failed"], baseline["modes"]) == (n, 0, {"plain": n})
    assert baseline["output_tokens"] > 0 and baseline["output_throughput"] > 0
    assert baseline["ttft_ms"]["p50"] > 0 and baseline["e2e_latency_ms"]["p50"] > 0

    compat = res["compatibility"]
    assert (compat["backend"], compat["device"], compat["dtype"]) == (cfg.engine.backend, cfg.engine.device,
                                                                      cfg.engine.dtype)
    assert compat["redrafter"]["drafter"] == str(cfg.drafter.path) and compat["features"]
    assert compat["versions"]["torch"] and compat["versions"]["rdserve"]
    server = compat["server"]
    assert server["status"] == "ok" and server["model"] == cfg.model.name and server["speculative_available"]

    shapes = res["acceptance"]["shapes"]
    assert [(s["num_beams"], s["draft_len_per_beam"]) for s in shapes] == default_shapes(cfg)
    for shape in shapes:
        assert set(shape["by_category"]) == categories
        figures = shape["by_category"]["all"]
        assert figures["generation_steps"] > 0 and figures["tokens_per_step"] >= 1.0
        assert len(figures["acceptance_rate_by_position"]) == shape["draft_len_per_beam"]
    assert any(s["by_category"]["all"]["accepted_draft_tokens"] > 0 for s in shapes)  # the drafter drafts

    quality = res["quality"]
    greedy = quality["greedy"]
    assert greedy["compared"] == n and greedy["passed"], greedy  # speculation is lossless on the default path
    # and so are its logprobs: the default compute path's rows do not depend on the rows beside them
    assert greedy["logprobs"]["compared_tokens"] > 0 and greedy["logprobs"]["max_abs_diff"] == 0, greedy["logprobs"]
    assert set(quality["task_checks"]) == {"valid_json", "final_number", "code_parses"}
    assert quality["sampled"]["samples_per_prompt"] == 2 and 0.0 <= quality["sampled"]["tv_spec_vs_plain"] <= 1.0

    staged = res["staged_load"]
    assert staged["levels"] == [1, 2] and set(staged["closed_loop"]) == {"spec", "plain", "auto"}
    for mode, runs in staged["closed_loop"].items():
        assert [r["completed"] for r in runs] == [2, 4] and all(r["failed"] == 0 for r in runs), mode
        assert all(r["output_throughput"] > 0 and r["goodput"] is not None for r in runs), mode
    assert staged["closed_loop"]["plain"][0]["modes"] == {"plain": 2}
    assert staged["closed_loop"]["spec"][0]["modes"] == {"spec": 2}
    assert set(staged["open_loop"]["by_mode"]) == {"spec", "plain", "auto"}
    assert set(staged["decision"]["pays_by_level"]) == {"1", "2"}

    report = (out / "report.md").read_text()
    for heading in ("1. Baseline", "2. Compatibility", "3. Acceptance", "4. Quality", "5. Staged load"):
        assert heading in report
    assert (out / "acceptance.png").stat().st_size > 0 and (out / "load.png").stat().st_size > 0
