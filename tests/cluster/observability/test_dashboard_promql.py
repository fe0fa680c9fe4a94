"""Dashboard PromQL on synthetic series with promtool (no cluster): a drafter that never had a token
accepted shows acceptance 0 and mean acceptance length 1, not "No data"."""

import subprocess

import yaml
from prom_tools import prometheus_binary

from cluster.observability.dashboard import panels


def _expr(panel_title: str, legend: str) -> str:
    panel = next(p for p in panels() if p.title == panel_title)
    expr = next(e for e, lg in panel.targets if lg == legend)
    return expr.replace("$model", ".*").replace("$pool", ".*").replace("$__rate_interval", "5m")


def test_acceptance_panels_show_a_drafter_that_never_accepts(tmp_path):
    promtool = prometheus_binary("promtool")
    labels = '{model_name="m", deployment="EngineReplica"}'
    series = [{"series": f"ray_rdserve_{name}_total{labels}", "values": f"0+{step}x20"}
              for name, step in (("spec_decode_num_drafts", 60), ("spec_decode_num_draft_tokens", 240),
                                 ("generation_steps", 60))]  # no spec_decode_num_accepted_tokens series at all
    cases = [("Acceptance rate", "acceptance rate", 0), ("Mean acceptance length", "mean acceptance length", 1),
             ("Mean acceptance length", "tokens per step", 1)]
    tests = {"tests": [{"interval": "1m", "input_series": series, "promql_expr_test": [
        {"expr": _expr(title, legend), "eval_time": "10m", "exp_samples": [{"labels": "{}", "value": value}]}
        for title, legend, value in cases]}]}
    (tmp_path / "t.yml").write_text(yaml.safe_dump(tests))
    run = subprocess.run([promtool, "test", "rules", "t.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
