"""The README's path on the tiny model: ``rdserve up`` prints where the metrics are; that URL (Ray's
metrics agent on ``observability.metrics_port``) serves rdserve's series once a request was served.
Also: a metrics port in use is a config error naming the field, and the commands' help fits 80 columns."""

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from ray_cluster import read_all, stop_process_group
from typer.testing import CliRunner

from cluster.cli.main import app

REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", [["dashboards", "build"], ["dashboards", "push"],
                                     ["observability", "prometheus-config"]])
def test_help_fits_80_columns(command):
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0 and "Usage" in result.output
    assert "…" not in result.output and max(len(line) for line in result.output.splitlines()) <= 80


@pytest.mark.parametrize("field", ["observability.metrics_port", "serve.port"])
def test_up_refuses_a_port_in_use_before_touching_the_environment(tiny_config_path, field, monkeypatch):
    monkeypatch.delenv("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", raising=False)
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        section, key = field.split(".")
        config = tiny_config_path.parent / "busy_port.yaml"
        config.write_text(tiny_config_path.read_text() + f"{section}: {{{key}: {busy.getsockname()[1]}}}\n")
        result = CliRunner().invoke(app, ["up", "--config", str(config)])
    assert result.exit_code == 2 and field in result.output
    # a refused start leaves no direct-ingress port behind for a later `rdserve up` of this process's children
    assert "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT" not in os.environ


def test_up_prints_the_metrics_url_which_serves_rdserve_series(tiny_config_path):
    port, metrics_port = free_port(), free_port()
    config = tiny_config_path.parent / "up_metrics.yaml"
    config.write_text(tiny_config_path.read_text() + f"serve: {{port: {port}}}\n"
                      f"observability: {{metrics_port: {metrics_port}}}\n")
    out = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("rdserve")), "up", "--config", str(config)], cwd=REPO,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "COLUMNS": "200",
                                 "RAY_metrics_report_interval_ms": "1000"})  # Ray's default: 10 s
    try:
        url, deadline = None, time.monotonic() + 300
        while url is None and time.monotonic() < deadline:
            assert proc.poll() is None, _read(out)
            found = re.search(r"metrics \(Prometheus\): (http://\S+/metrics)", _read(out))
            url = found and found.group(1)
            time.sleep(1)
        assert url == f"http://127.0.0.1:{metrics_port}/metrics", _read(out)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny-llama", "prompt": "Hello", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        tokens = r.json()["usage"]["completion_tokens"]
        deadline, text = time.monotonic() + 60, ""
        while time.monotonic() < deadline:
            text = httpx.get(url, timeout=10).text
            series = rf'^ray_rdserve_generation_tokens_total{{.*model_name="tiny-llama".*}} {tokens}\.0$'
            if re.search(series, text, re.M):
                break
            time.sleep(2)
        else:
            pytest.fail(f"no ray_rdserve_generation_tokens_total of {tokens} at {url} within 60 s")
        assert "ray_serve_" in text
        # GET /metrics on the API port proxies the same agent
        assert "ray_rdserve_generation_tokens_total" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        stop_process_group(proc)


_read = read_all
