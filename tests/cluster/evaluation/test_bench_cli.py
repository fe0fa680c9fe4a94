"""``rdserve bench`` end to end against the synthetic server."""

import json

from synthetic_server import Delays, SyntheticServer
from typer.testing import CliRunner

from cluster.cli.main import app


def test_bench_writes_every_figure(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a", "category": "x"}\n{"prompt": "b", "category": "y"}\n')
    with SyntheticServer(Delays(first_s=0.05, gap_s=0.02, chunks=3)) as url:
        result = CliRunner().invoke(app, ["bench", "--url", url, "--prompts", str(prompts), "--model", "m",
                                          "--concurrency", "1,2", "--max-requests", "4", "--mode", "plain",
                                          "--slo-ttft-ms", "1000", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [r["spec"]["concurrency"] for r in data["runs"]] == [1, 2]
    assert all(r["summary"]["completed"] == 4 and r["summary"]["goodput"] > 0 for r in data["runs"])
    assert len(data["runs"][0]["records"]) == 4


def test_bench_rejects_bad_arguments(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"category": "x"}\n')
    result = CliRunner().invoke(app, ["bench", "--url", "http://127.0.0.1:9", "--prompts", str(prompts)])
    assert result.exit_code == 2 and "exactly one of 'prompt' and 'messages'" in result.output
