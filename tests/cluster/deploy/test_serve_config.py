"""The Serve config of an rdserve config and the application builder Ray imports from it."""

from pathlib import Path

import pytest
import yaml
from ray.serve import Application

from cluster.deploy.app import app_builder, build_app
from cluster.config import ConfigError, load_config, parse_config
from cluster.deploy.app_args import PROJECT_ROOT, config_from_args
from cluster.deploy.serve_config import deployment_options, portable_config, serve_config

LOCAL = PROJECT_ROOT / "configs" / "local.yaml"


def test_portable_config_round_trips_with_project_relative_paths():
    cfg = load_config(PROJECT_ROOT / "configs" / "autoscale.yaml")
    data = portable_config(cfg)
    assert data["drafter"]["path"] == "workers/drafters/smollm2-135m-instruct"
    assert parse_config(data, PROJECT_ROOT) == cfg


def test_paths_outside_the_project_stay_absolute(tiny_config):
    data = portable_config(tiny_config)
    assert Path(data["model"]["path"]).is_absolute() and Path(data["model"]["path"]) == tiny_config.model.path
    assert config_from_args({"config": data}) == tiny_config


def test_builder_args_inline_or_path():
    cfg = load_config(LOCAL)
    assert config_from_args({"config_path": "configs/local.yaml"}) == cfg
    assert config_from_args({"config": portable_config(cfg)}) == cfg
    assert isinstance(app_builder({"config_path": str(LOCAL)}), Application)


@pytest.mark.parametrize("args, message", [
    ({}, "exactly one of 'config'"),
    ({"config": {}, "config_path": "configs/local.yaml"}, "exactly one of 'config'"),
    ({"config_file": "x.yaml"}, "config_file"),
    ({"config": {"engine": {"tp_size": 0}}}, "args.config: engine.tp_size"),
    ({"config": {"drafter": {"path": "no/such/dir"}}}, "drafter.path: directory not found"),
    ({"config_path": "configs/none.yaml"}, "cannot read config file"),
])
def test_bad_builder_args_name_the_field(args, message):
    with pytest.raises(ConfigError, match=message):
        app_builder(args)


def test_deployments_section_is_what_the_code_binds():
    cfg = load_config(PROJECT_ROOT / "configs" / "autoscale.yaml")
    config = serve_config(cfg)
    (application,) = config["applications"]
    assert config["http_options"] == {"host": cfg.serve.host, "port": cfg.serve.port}
    engine = next(d for d in application["deployments"] if d["name"] == "EngineReplica")
    scaling = cfg.serve.autoscaling
    assert engine["max_ongoing_requests"] == cfg.serve.max_ongoing_requests
    assert engine["autoscaling_config"]["min_replicas"] == scaling.min_replicas
    assert engine["autoscaling_config"]["policy"]["policy_function"] == "cluster.routing.autoscaling:RdserveAutoscalingPolicy"
    assert engine["request_router_config"]["request_router_class"] == "cluster.routing.request_router:GoodputRequestRouter"
    assert engine["graceful_shutdown_timeout_s"] == scaling.graceful_shutdown_timeout_s
    assert "num_replicas" not in engine
    assert deployment_options(config_from_args(application["args"])) == application["deployments"]
    fixed = load_config(LOCAL)  # one replica: the engine runs in the ingress's process (serve.colocate auto)
    (ingress,) = deployment_options(fixed)
    assert ingress["name"] == "OpenAIIngress" and ingress["num_replicas"] == 1
    assert ingress["ray_actor_options"]["num_cpus"] == fixed.serve.num_cpus_per_replica  # the engine's CPUs
    assert ingress["health_check_period_s"] == engine["health_check_period_s"]  # probed as an engine replica is
    separate = fixed.model_copy(update={"serve": fixed.serve.model_copy(update={"colocate": False})})
    (engine,) = [d for d in deployment_options(separate) if d["name"] == "EngineReplica"]
    assert engine["num_replicas"] == fixed.serve.replicas and "autoscaling_config" not in engine
    assert len(build_app(separate)._bound_deployment.init_args) == 2  # ingress(engine handle, model name)


def test_keys_written_in_the_config_are_refused_not_masked(tmp_path):
    """Dumped, a SecretStr key becomes '**********': a Serve config carrying that would accept it as the key."""
    from typer.testing import CliRunner

    from cluster.cli.main import app

    listed = tmp_path / "listed.yaml"
    listed.write_text("serve: {api_keys: [sk-first-0123456789, sk-second-0123456789]}\n")
    out = tmp_path / "serve.yaml"
    result = CliRunner().invoke(app, ["serve-config", "--config", str(listed), "--out", str(out)])
    assert result.exit_code == 2 and not out.exists()
    (line,) = result.output.strip().splitlines()
    assert "serve.api_keys:" in line and "{env: RDSERVE_API_KEYS}" in line and "{file: PATH}" in line
    assert "sk-first" not in result.output and "****" not in result.output
    with pytest.raises(ConfigError, match="serve.api_keys"):
        serve_config(load_config(listed))
    with pytest.raises(ConfigError, match=r"args.config: serve.api_keys: .*only '\*' characters"):
        app_builder({"config": {"serve": {"api_keys": ["**********"]}}})  # a file written before this check
    by_env = tmp_path / "by_env.yaml"
    by_env.write_text("serve: {api_keys: {env: RDSERVE_API_KEYS}}\n")
    result = CliRunner().invoke(app, ["serve-config", "--config", str(by_env), "--out", str(out)])
    assert result.exit_code == 0, result.output
    (application,) = yaml.safe_load(out.read_text())["applications"]
    assert application["args"]["config"]["serve"]["api_keys"] == {"env": "RDSERVE_API_KEYS"}
