"""The committed examples in k8s/ are what `rdserve k8s render` gives for the presets today (`make k8s`)."""

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema
from typer.testing import CliRunner

from cluster.deploy.app import SERVE_ENV
from cluster.cli.main import app

PROJECT_ROOT = Path(__file__).resolve().parents[4]
EXAMPLES = {"cpu-demo": "configs/cpu-demo.yaml", "gpu-tp8": "configs/gpu-tp8.yaml"}


@pytest.mark.parametrize("example", EXAMPLES)
def test_committed_examples_are_current(example, tmp_path):
    result = CliRunner().invoke(app, ["k8s", "render", "--config", str(PROJECT_ROOT / EXAMPLES[example]),
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    committed = PROJECT_ROOT / "k8s" / example
    assert sorted(p.name for p in committed.glob("*.yaml")) == sorted(p.name for p in tmp_path.iterdir())
    for fresh in tmp_path.iterdir():
        assert (committed / fresh.name).read_text() == fresh.read_text(), \
            f"k8s/{example}/{fresh.name} is stale: run `make k8s` and commit the result"


def test_render_options_and_config_errors(tmp_path):
    result = CliRunner().invoke(app, ["k8s", "render", "--config", str(PROJECT_ROOT / EXAMPLES["cpu-demo"]),
                                      "--out", str(tmp_path), "--image", "registry.example/rdserve:1",
                                      "--namespace", "llm"])
    assert result.exit_code == 0, result.output
    service = yaml.safe_load((tmp_path / "rayservice.yaml").read_text())
    assert service["metadata"]["namespace"] == "llm"
    assert service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == \
        "registry.example/rdserve:1"
    result = CliRunner().invoke(app, ["k8s", "render", "--config", str(PROJECT_ROOT / EXAMPLES["cpu-demo"]),
                                      "--out", str(tmp_path), "--namespace", "Not_A_Label"])
    assert result.exit_code == 2 and "--namespace" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("kubernetes: {worker_memory: lots}\n")
    result = CliRunner().invoke(app, ["k8s", "render", "--config", str(bad), "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "kubernetes.worker_memory" in result.output


def test_serve_config_command_prints_a_valid_serve_config():
    result = CliRunner().invoke(app, ["serve-config", "--config", str(PROJECT_ROOT / "configs" / "autoscale.yaml")])
    assert result.exit_code == 0, result.output
    serve = ServeDeploySchema.model_validate(yaml.safe_load(result.stdout))
    (application,) = serve.applications
    assert application.args["config"]["drafter"]["path"] == "workers/drafters/smollm2-135m-instruct"
    assert application.runtime_env == {"env_vars": SERVE_ENV}
    assert {d.name for d in application.deployments} == {"EngineReplica", "OpenAIIngress"}


@pytest.mark.parametrize("preset", sorted((PROJECT_ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_preset_renders_through_the_commands(preset, tmp_path):
    """`rdserve serve-config` and `rdserve k8s render` on every shipped preset (globbed, so a new one is
    covered): exit 0, a valid Serve config carrying the preset, and the manifests `cluster.deploy.k8s.render`
    gives, which tests/cluster/deploy/k8s/test_k8s_manifests.py validates against the CRD schemas for every preset.
    Loading and check_startable of every preset: tests/cluster/config/test_config.py."""
    from cluster.config import load_config, parse_config
    from cluster.deploy.k8s.render import manifests

    cfg = load_config(preset)
    result = CliRunner().invoke(app, ["serve-config", "--config", str(preset)])
    assert result.exit_code == 0, result.output
    (application,) = ServeDeploySchema.model_validate(yaml.safe_load(result.stdout)).applications
    assert parse_config(application.args["config"], PROJECT_ROOT) == cfg
    result = CliRunner().invoke(app, ["k8s", "render", "--config", str(preset), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    expected = manifests(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(expected)
    for name, obj in expected.items():
        assert yaml.safe_load((tmp_path / name).read_text()) == obj, name


def test_image_ray_matches_the_manifests():
    import re

    dockerfile = (PROJECT_ROOT / "k8s" / "Dockerfile").read_text()
    (ray_version,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.M)
    for example in EXAMPLES:
        service = yaml.safe_load((PROJECT_ROOT / "k8s" / example / "rayservice.yaml").read_text())
        assert service["spec"]["rayClusterConfig"]["rayVersion"] == ray_version, \
            f"k8s/Dockerfile installs Ray {ray_version}, k8s/{example} was rendered for another Ray"
