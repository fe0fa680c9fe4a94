"""`rdserve k8s render`'s objects validated offline: the RayService against KubeRay v1.7.0's schema, the
PodMonitor against the Prometheus Operator CRD, built-in kinds with kubernetes-validate, serveConfigV2
with Ray's ServeDeploySchema and our config model; plus what KubeRay would mishandle."""

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.config import ConfigError, load_config, parse_config
from cluster.deploy.k8s.pods import pod_config
from cluster.deploy.k8s.render import manifests

PROJECT_ROOT = Path(__file__).resolve().parents[4]
KUBERNETES_VERSION = "1.33.0"
"""Built-in kinds (Namespace, the OpenAI Service) are validated for this Kubernetes version."""
PRESETS = {p.stem: p for p in sorted((PROJECT_ROOT / "configs").glob("*.yaml"))}
"""Every shipped preset, globbed so that a new one is covered; some tests below check cpu-demo or gpu-tp8 alone."""


def errors(schema: dict, obj: dict) -> list[str]:
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[str, dict]]:
    return {name: manifests(load_config(path)) for name, path in PRESETS.items()}


def _config(tmp_path: Path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(f"drafter: {{path: {PROJECT_ROOT}/workers/drafters/smollm2-135m-instruct}}\n" + text)
    return load_config(path)


@pytest.mark.parametrize("preset", PRESETS)
def test_rayservice_matches_kuberay_schema(rendered, rayservice_schema, preset):
    assert errors(rayservice_schema, rendered[preset]["rayservice.yaml"]) == []


@pytest.mark.parametrize("preset", PRESETS)
def test_podmonitor_matches_prometheus_operator_crd(rendered, podmonitor_schema, preset):
    monitor = rendered[preset]["podmonitor.yaml"]
    assert errors(podmonitor_schema, monitor) == []
    broken = copy.deepcopy(monitor)
    broken["spec"]["podMetricsEndpoints"][0]["prot"] = broken["spec"]["podMetricsEndpoints"][0].pop("port")
    assert any("prot" in e for e in errors(podmonitor_schema, broken))


@pytest.mark.parametrize("preset", PRESETS)
def test_builtin_kinds_validate(rendered, preset):
    objects = rendered[preset]
    kubernetes_validate.validate(objects["namespace.yaml"], KUBERNETES_VERSION, strict=True)
    service = {"apiVersion": "v1", "kind": "Service", **objects["rayservice.yaml"]["spec"]["serveService"]}
    kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)
    service["spec"]["portz"] = service["spec"].pop("ports")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)


def test_misspelt_fields_rejected(rendered, rayservice_schema):
    service = rendered["cpu-demo"]["rayservice.yaml"]
    for path, wrong in ((("spec", "rayClusterConfig", "workerGroupSpecs", 0), "maxReplica"),
                        (("spec", "rayClusterConfig", "headGroupSpec"), "rayStartParam"),
                        (("spec",), "serveConfigV3")):
        broken = copy.deepcopy(service)
        node = broken
        for key in path:
            node = node[key]
        node[wrong] = "1"
        assert any(wrong in e for e in errors(rayservice_schema, broken)), wrong


def test_what_kuberay_would_mishandle_is_rejected(rendered, rayservice_schema):
    service = rendered["gpu-tp8"]["rayservice.yaml"]
    not_string = copy.deepcopy(service)
    not_string["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 8
    assert errors(rayservice_schema, not_string)
    no_min = copy.deepcopy(service)
    del no_min["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplicas"]
    assert any("minReplicas" in e for e in errors(rayservice_schema, no_min))
    as_object = copy.deepcopy(service)
    as_object["spec"]["serveConfigV2"] = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert any("serveConfigV2" in e for e in errors(rayservice_schema, as_object))


@pytest.mark.parametrize("preset", PRESETS)
def test_serve_config_v2_is_a_valid_serve_config_of_our_config(rendered, preset):
    cfg = load_config(PRESETS[preset])
    text = rendered[preset]["rayservice.yaml"]["spec"]["serveConfigV2"]
    assert isinstance(text, str)
    serve = ServeDeploySchema.model_validate(yaml.safe_load(text))
    app = serve.applications[0]
    assert app.import_path == "cluster.deploy.app:app_builder" and app.route_prefix == "/"
    assert parse_config(app.args["config"], PROJECT_ROOT) == pod_config(cfg)
    assert serve.http_options.host == "0.0.0.0" and serve.http_options.port == cfg.serve.port
    engine = next((d for d in app.deployments if d.name == "EngineReplica"), None)
    if engine is None:  # one colocated replica (serve.colocate): the engine runs in the ingress's process
        (ingress,) = app.deployments
        assert ingress.name == "OpenAIIngress" and ingress.num_replicas == cfg.serve.replicas == 1
        return
    assert engine.max_ongoing_requests == cfg.serve.max_ongoing_requests
    if cfg.serve.autoscaling is None:
        assert engine.num_replicas == cfg.serve.replicas
    else:
        assert engine.autoscaling_config["max_replicas"] == cfg.serve.autoscaling.max_replicas


def test_gpu_tp8_reserves_eight_gpus_per_replica_and_pod(rendered):
    cfg = load_config(PRESETS["gpu-tp8"])
    service = rendered["gpu-tp8"]["rayservice.yaml"]
    app = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
    engine = next(d for d in app["deployments"] if d["name"] == "EngineReplica")
    assert engine["placement_group_strategy"] == "STRICT_PACK"
    assert [b["GPU"] for b in engine["placement_group_bundles"]] == [1.0] * 8
    assert engine["ray_actor_options"]["num_gpus"] == 1.0
    (group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    container = group["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8" == group["rayStartParams"]["num-gpus"]
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 2)
    assert service["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    shm = next(v for v in group["template"]["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert {"containerPort": cfg.observability.metrics_port, "name": "metrics"} in container["ports"]


def test_worker_pods_name_the_serve_port(tmp_path):
    """KubeRay's readiness probe of a RayService worker asks the Serve proxy at the container port named
    "serve" (8000 when none is): with another serve.port the workers would never become ready."""
    service = manifests(_config(tmp_path, "serve: {port: 9000}\n"))["rayservice.yaml"]
    for group in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        assert {"containerPort": 9000, "name": "serve"} in group["template"]["spec"]["containers"][0]["ports"]


def test_fixed_replicas_and_two_pools(tmp_path):
    fixed = manifests(_config(tmp_path, "serve: {replicas: 3}\n"))["rayservice.yaml"]["spec"]["rayClusterConfig"]
    assert [(g["groupName"], g["minReplicas"], g["maxReplicas"]) for g in fixed["workerGroupSpecs"]] == \
        [("engine", 3, 3)]
    assert "enableInTreeAutoscaling" not in fixed
    pools = _config(tmp_path, f"speculation: {{calibration: {PROJECT_ROOT}/configs/local.calibration.json, "
                    "num_beams: 2, draft_len_per_beam: 2}\n"
                    "serve: {pools: {spec: {replicas: 2}, plain: {autoscaling: {min_replicas: 1, max_replicas: 4}}}}\n")
    cluster = manifests(pools)["rayservice.yaml"]["spec"]["rayClusterConfig"]
    assert [(g["groupName"], g["minReplicas"], g["maxReplicas"]) for g in cluster["workerGroupSpecs"]] == \
        [("engine-spec", 2, 2), ("engine-plain", 1, 4)]
    assert cluster["enableInTreeAutoscaling"] is True


def test_api_keys_come_from_a_secret(tmp_path, rayservice_schema):
    cfg = _config(tmp_path, "serve: {api_keys: {env: RDSERVE_API_KEYS}}\nkubernetes: {name: chat}\n")
    service = manifests(cfg)["rayservice.yaml"]
    assert errors(rayservice_schema, service) == []
    cluster = service["spec"]["rayClusterConfig"]
    for template in [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]:
        env = template["spec"]["containers"][0]["env"]
        assert {"name": "RDSERVE_API_KEYS", "valueFrom": {"secretKeyRef": {"name": "chat-api-keys", "key": "keys"}}} in env
    by_file = manifests(_config(tmp_path, "serve: {api_keys: {file: /etc/rdserve/keys.txt}}\n"))["rayservice.yaml"]
    assert errors(rayservice_schema, by_file) == []
    pod = by_file["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert {"name": "api-keys", "secret": {"secretName": "rdserve-api-keys",
                                           "items": [{"key": "keys", "path": "keys"}]}} in pod["volumes"]
    assert {"name": "api-keys", "mountPath": "/etc/rdserve/keys.txt", "subPath": "keys", "readOnly": True} in \
        pod["containers"][0]["volumeMounts"]
    # only the file is mounted: a key file in /tmp or in the project must not hide the rest of that directory
    for where, mount_path in (("/tmp/keys.txt", "/tmp/keys.txt"), (f"{PROJECT_ROOT}/keys.txt", "/opt/rdserve/keys.txt")):
        service = manifests(_config(tmp_path, f"serve: {{api_keys: {{file: {where}}}}}\n"))["rayservice.yaml"]
        mounts = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        assert [m["mountPath"] for m in mounts if m["name"] == "api-keys"] == [mount_path]
    with pytest.raises(ConfigError, match="serve.api_keys.file"):
        manifests(_config(tmp_path, "serve: {api_keys: {file: /models/keys.txt}}\nkubernetes: {models_claim: m}\n"))
    with pytest.raises(ConfigError, match="serve.api_keys"):
        manifests(_config(tmp_path, "serve: {api_keys: [abcdefgh12345]}\n"))


def test_pod_config_rejects_what_a_pod_cannot_run(tmp_path):
    with pytest.raises(ConfigError, match="model.path"):
        manifests(_config(tmp_path, "model: {path: /home/me/llama}\n"))
    with pytest.raises(ConfigError, match="num_cpus_per_replica"):
        manifests(_config(tmp_path, "serve: {num_cpus_per_replica: 0.5}\n"))
    with pytest.raises(ConfigError, match="kubernetes.worker_cpus"):
        manifests(_config(tmp_path, "serve: {num_cpus_per_replica: 8}\nkubernetes: {worker_cpus: 4}\n"))
    with pytest.raises(ConfigError, match="model.path: .* kubernetes.models_claim is null"):
        manifests(_config(tmp_path, "model: {path: /models/llama}\n"))
    with pytest.raises(ConfigError, match="speculation.calibration: /home/me/cal.json is neither"):
        manifests(_config(tmp_path, "speculation: {policy: auto, calibration: /home/me/cal.json}\n"))
    with pytest.raises(ConfigError, match="observability.metrics_port: port 8080 is already serve.port"):
        manifests(_config(tmp_path, "serve: {port: 8080}\nobservability: {metrics_port: 8080}\n"))
    with pytest.raises(ConfigError, match="serve.port: port 8265 is already Ray's dashboard port"):
        manifests(_config(tmp_path, "serve: {port: 8265}\n"))
    with pytest.raises(ConfigError, match="engine.device: cuda:1"):
        manifests(_config(tmp_path, "engine: {device: 'cuda:1'}\n"))
    cfg = pod_config(_config(tmp_path, "engine: {tp_size: 2}\nkubernetes: {worker_cpus: 6}\n"))
    assert cfg.engine.num_threads == 3 and cfg.serve.host == "0.0.0.0"
