"""A rolling upgrade or a pod's stop does not cut streams: the rendered grace period, drain on SIGTERM,
preStop hook and old-cluster deletion delay agree with the Serve config's shutdown timeouts and
validate against KubeRay v1.7.0's schema."""

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml

from cluster.config import load_config
from cluster.deploy.k8s.render import manifests
from cluster.deploy.k8s.shutdown import DRAIN_ENV, PRESTOP_S

PROJECT_ROOT = Path(__file__).resolve().parents[4]
PRESETS = {"cpu-demo": PROJECT_ROOT / "configs" / "cpu-demo.yaml", "gpu-tp8": PROJECT_ROOT / "configs" / "gpu-tp8.yaml"}


def _pods(service: dict) -> list[dict]:
    cluster = service["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]


def _longest_shutdown_s(service: dict) -> float:
    """The longest ``graceful_shutdown_timeout_s`` in ``serveConfigV2`` (Serve's default 20 s where unset)."""
    app = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
    return max(d.get("graceful_shutdown_timeout_s", 20.0) for d in app["deployments"])


def check_no_stream_is_cut(service: dict, drain_timeout_s: float) -> int:
    """Assert the shutdown fields of ``service`` cover its Serve config's timeouts; return the drain (s)."""
    longest = max(_longest_shutdown_s(service), drain_timeout_s)
    assert service["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    drain = service["spec"]["rayClusterDeletionDelaySeconds"]
    assert drain >= longest  # the old cluster outlives every stream it admitted before the switch
    for pod in _pods(service):
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert float(env[DRAIN_ENV]) == drain
        assert container["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_S)]}}}
        grace = pod["terminationGracePeriodSeconds"]
        assert isinstance(grace, int) and grace > PRESTOP_S + drain  # SIGKILL only after the drain ended
    return drain


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_drain_for_their_graceful_shutdown(preset, rayservice_schema):
    cfg = load_config(PRESETS[preset])
    service = manifests(cfg)["rayservice.yaml"]
    validator = jsonschema.validators.validator_for(rayservice_schema)(rayservice_schema)
    assert [e.message for e in validator.iter_errors(service)] == []
    assert check_no_stream_is_cut(service, cfg.serve.drain_timeout_s) == 600  # autoscaling's 600 s
    misspelt = copy.deepcopy(service)
    misspelt["spec"]["rayClusterDeletionDelaySecond"] = misspelt["spec"].pop("rayClusterDeletionDelaySeconds")
    assert any("rayClusterDeletionDelaySecond" in e.message for e in validator.iter_errors(misspelt))


@pytest.mark.parametrize("serve_section,expected", [
    ("serve: {replicas: 2, drain_timeout_s: 90.5}", 91),  # no autoscaling: Serve's timeout is drain_timeout_s
    ("serve: {autoscaling: {min_replicas: 1, max_replicas: 2, graceful_shutdown_timeout_s: 1200}}", 1200),
    ("serve: {pools: {spec: {replicas: 1}, plain: {autoscaling: {min_replicas: 1, max_replicas: 3, "
     "graceful_shutdown_timeout_s: 45}}}, drain_timeout_s: 40}", 45),
])
def test_drain_follows_the_config(tmp_path, serve_section, expected, rayservice_schema):
    path = tmp_path / "c.yaml"
    calibration = f"speculation: {{calibration: {PROJECT_ROOT}/configs/local.calibration.json, num_beams: 2, " \
                  "draft_len_per_beam: 2}\n" if "pools" in serve_section else ""
    path.write_text(f"drafter: {{path: {PROJECT_ROOT}/workers/drafters/smollm2-135m-instruct}}\n{calibration}"
                    f"{serve_section}\n")
    cfg = load_config(path)
    service = manifests(cfg)["rayservice.yaml"]
    validator = jsonschema.validators.validator_for(rayservice_schema)(rayservice_schema)
    assert [e.message for e in validator.iter_errors(service)] == []
    assert check_no_stream_is_cut(service, cfg.serve.drain_timeout_s) == expected


@pytest.mark.parametrize("example", PRESETS)
def test_committed_examples_carry_the_drain(example):
    service = yaml.safe_load((PROJECT_ROOT / "k8s" / example / "rayservice.yaml").read_text())
    check_no_stream_is_cut(service, load_config(PRESETS[example]).serve.drain_timeout_s)
