"""``benchmarks/metrics_overhead.py`` runs end to end on the tiny model (one on/off round, tiny loads):
two real ``rdserve up`` processes, one with metrics and one without, a table and JSON out."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_metrics_overhead_script_runs_on_the_tiny_model(tiny_config_path, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Tell me about {w}."}]}) + "\n"
                               for w in ("rain", "stars")))
    out = tmp_path / "overhead"
    proc = subprocess.run(
        [sys.executable, "benchmarks/metrics_overhead.py", "--config", str(tiny_config_path), "--prompts", str(prompts),
         "--num-prompts", "2", "--max-tokens", "8", "--concurrency", "1,2", "--rounds", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert set(results) == {"plain c=1", "plain c=2", "spec c=1", "spec c=2"}
    for r in results.values():
        assert r["on_tok_s"] > 0 and r["off_tok_s"] > 0
        assert abs(r["overhead"] - (1 - r["on_tok_s"] / r["off_tok_s"])) < 1e-9
    assert "| spec | 2 |" in out.with_suffix(".md").read_text() and "overhead" in proc.stdout
