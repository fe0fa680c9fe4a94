"""The objects of ``rdserve k8s render``: a KubeRay ``RayService`` (``ray.io/v1``, KubeRay v1.7), its
``PodMonitor`` (Prometheus Operator ``monitoring.coreos.com/v1``) and the namespace.

Shape of the RayService (as KubeRay's ``ray-service.*.yaml`` samples): ``serveConfigV2`` is the Serve
config of :func:`cluster.deploy.serve_config.serve_config` as a YAML string; the head group runs no engine
(``num-cpus: "0"``: Serve's controller, proxy and the zero-CPU ingress only); one worker group per
engine pool, one engine replica per pod (the pod's Ray node advertises one replica's CPUs and
``engine.tp_size`` GPUs), bounded by the pool's Serve replica bounds. With Serve autoscaling, Serve
sets the replica count and the in-tree autoscaler adds or removes pods for pending/idle replicas.
The OpenAI endpoint is ``spec.serveService``: KubeRay keeps that Service pointed at the healthy
proxies of the active cluster, also across a zero-downtime upgrade (a standalone Service could
not follow the cluster's generated name). How pods and an upgraded cluster stop without cutting
streams (grace period, drain on SIGTERM, preStop, deletion delay): :mod:`cluster.deploy.k8s.shutdown`.
"""

from __future__ import annotations

import ray

from cluster.config import RdserveConfig
from cluster.deploy.k8s.pods import (CLIENT_PORT, DASHBOARD_PORT, GCS_PORT, IMAGE_PROJECT_DIR, container_env,
                              engine_pools, gpus_per_pod, metrics_port, pod_config, ray_cpus, volumes)
from cluster.deploy.k8s.shutdown import PodShutdown, pod_shutdown
from cluster.deploy.serve_config import serve_config, to_yaml

GPU_RESOURCE = "nvidia.com/gpu"


def _labels(name: str) -> dict:
    return {"app.kubernetes.io/name": "rdserve", "app.kubernetes.io/instance": name}


def _container(role: str, image: str, cpus: int, memory: str, gpus: int, ports: list[dict], env: list[dict],
               mounts: list[dict], shutdown: PodShutdown) -> dict:
    quantities = {"cpu": str(cpus), "memory": memory, **({GPU_RESOURCE: str(gpus)} if gpus else {})}
    return {"name": f"ray-{role}", "image": image, "workingDir": str(IMAGE_PROJECT_DIR),
            "resources": {"requests": dict(quantities), "limits": dict(quantities)},
            "ports": ports, "env": env + shutdown.env(), "volumeMounts": mounts, "lifecycle": shutdown.lifecycle()}


def _pod_template(name: str, container: dict, vols: list[dict], gpus: int, shutdown: PodShutdown) -> dict:
    spec = {"terminationGracePeriodSeconds": shutdown.grace_s, "containers": [container], "volumes": vols}
    if gpus:  # GPU nodes are commonly tainted so that only GPU pods land there
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return {"metadata": {"labels": _labels(name)}, "spec": spec}


def rayservice(cfg: RdserveConfig, image: str, namespace: str) -> dict:
    """The ``RayService`` running ``cfg`` (see the module docstring); ``cfg`` as loaded, paths resolved.

    Raises:
        ConfigError: what :func:`cluster.deploy.k8s.pods.pod_config` rejects.
    """
    k8s, name = cfg.kubernetes, cfg.kubernetes.name
    pod_cfg = pod_config(cfg)
    serve = serve_config(pod_cfg, host="0.0.0.0", port=cfg.serve.port)
    shutdown = pod_shutdown(pod_cfg, serve["applications"][0]["deployments"])
    secret = f"{name}-api-keys"
    env, (vols, mounts) = container_env(cfg, secret), volumes(cfg, secret)
    metrics = {"containerPort": metrics_port(cfg), "name": "metrics"}
    head_ports = [{"containerPort": GCS_PORT, "name": "gcs-server"},
                  {"containerPort": DASHBOARD_PORT, "name": "dashboard"},
                  {"containerPort": CLIENT_PORT, "name": "client"},
                  {"containerPort": cfg.serve.port, "name": "serve"}, metrics]
    head = {
        "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0",
                           "metrics-export-port": str(metrics_port(cfg))},
        "template": _pod_template(name, _container("head", image, k8s.head_cpus, k8s.head_memory, 0, head_ports,
                                                   env, mounts, shutdown), vols, 0, shutdown),
    }
    gpus = gpus_per_pod(cfg)
    groups = []
    for pool in engine_pools(cfg):
        params = {"num-cpus": ray_cpus(cfg), "metrics-export-port": str(metrics_port(cfg))}
        if gpus:
            params["num-gpus"] = str(gpus)
        # KubeRay's readiness probe of a RayService worker asks the Serve proxy at the port named "serve"
        ports = [{"containerPort": cfg.serve.port, "name": "serve"}, dict(metrics)]
        container = _container("worker", image, k8s.worker_cpus, k8s.worker_memory, gpus, ports, env, mounts,
                               shutdown)
        groups.append({"groupName": pool.group, "replicas": pool.min_replicas, "minReplicas": pool.min_replicas,
                       "maxReplicas": pool.max_replicas, "rayStartParams": params,
                       "template": _pod_template(name, container, vols, gpus, shutdown)})
    cluster = {"rayVersion": ray.__version__, "headGroupSpec": head, "workerGroupSpecs": groups}
    if any(pool.autoscaling for pool in engine_pools(cfg)):
        cluster["enableInTreeAutoscaling"] = True
        cluster["autoscalerOptions"] = {"upscalingMode": "Default", "idleTimeoutSeconds": k8s.idle_timeout_s}
    openai = {"metadata": {"name": f"{name}-openai", "labels": _labels(name)},
              "spec": {"type": "ClusterIP",
                       "ports": [{"name": "serve", "port": cfg.serve.port, "targetPort": cfg.serve.port}]}}
    return {
        "apiVersion": "ray.io/v1", "kind": "RayService",
        "metadata": {"name": name, "namespace": namespace, "labels": _labels(name)},
        "spec": {"serveConfigV2": to_yaml(serve), "serveService": openai, **shutdown.upgrade(),
                 "rayClusterConfig": cluster},
    }


def pod_monitor(cfg: RdserveConfig, namespace: str) -> dict:
    """A ``PodMonitor`` scraping Ray's metrics port (named ``metrics``) on every pod of the RayService:
    Ray's and Serve's metrics and the rdserve metrics exported through Ray."""
    name = cfg.kubernetes.name
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": {"name": f"{name}-ray-metrics", "namespace": namespace, "labels": _labels(name)},
        "spec": {"selector": {"matchLabels": _labels(name)},
                 "namespaceSelector": {"matchNames": [namespace]},
                 "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}]},
    }


def namespace_object(namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
