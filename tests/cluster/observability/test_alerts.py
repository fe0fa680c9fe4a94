"""The alert rules and scrape config pass promtool, and the rules' unit tests pass (alerts_test.yml)."""

import shutil
import subprocess
from pathlib import Path

import yaml
from prom_tools import prometheus_binary
from typer.testing import CliRunner

import cluster.observability
from cluster.cli.main import app

UNIT_TESTS = Path(cluster.observability.__file__).parent / "alerts_test.yml"


def test_prometheus_config_command_writes_files_promtool_accepts(tmp_path, tiny_config_path):
    promtool = prometheus_binary("promtool")
    result = CliRunner().invoke(app, ["observability", "prometheus-config", "--out", str(tmp_path), "--config",
                                      str(tiny_config_path), "--target", "10.0.0.1:8080", "--target", "10.0.0.2:8080"])
    assert result.exit_code == 0, result.output
    config = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["10.0.0.1:8080", "10.0.0.2:8080"]
    rules = yaml.safe_load((tmp_path / "rdserve-alerts.yml").read_text())
    assert {r["alert"] for r in rules["groups"][0]["rules"]} == {
        "RdserveTTFTSLOBreach", "RdserveHighErrorRate", "RdserveSpecAcceptanceCollapse", "RdserveReplicasFlapping",
        "RdserveKVCacheNearFull"}
    for args in (["check", "rules", "rdserve-alerts.yml"], ["check", "config", "prometheus.yml"]):
        check = subprocess.run([promtool, *args], cwd=tmp_path, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr


def test_alert_rules_unit_tests_pass(tmp_path, tiny_config_path):
    promtool = prometheus_binary("promtool")
    result = CliRunner().invoke(app, ["observability", "prometheus-config", "--out", str(tmp_path), "--config",
                                      str(tiny_config_path)])  # default thresholds, as alerts_test.yml expects
    assert result.exit_code == 0, result.output
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    run = subprocess.run([promtool, "test", "rules", UNIT_TESTS.name], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_a_sub_second_scrape_interval_is_a_duration_prometheus_accepts(tmp_path, tiny_config_path):
    promtool = prometheus_binary("promtool")
    result = CliRunner().invoke(app, ["observability", "prometheus-config", "--out", str(tmp_path), "--config",
                                      str(tiny_config_path), "--scrape-interval", "0.25"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((tmp_path / "prometheus.yml").read_text())["global"]["scrape_interval"] == "250ms"
    check = subprocess.run([promtool, "check", "config", "prometheus.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_target_that_is_not_host_port_is_refused_naming_the_option(tmp_path, tiny_config_path):
    for bad in ("http://10.0.0.1:8080", "10.0.0.1", "10.0.0.1:port"):
        result = CliRunner().invoke(app, ["observability", "prometheus-config", "--out", str(tmp_path / "p"),
                                          "--config", str(tiny_config_path), "--target", bad])
        assert result.exit_code == 2 and "--target" in result.output and "HOST:PORT" in result.output, result.output
        assert not (tmp_path / "p").exists()
