"""What the Ray pods of an rdserve RayService run: the config as seen inside a pod, engine pools, ports,
environment and volumes. Pure functions of the config; :mod:`cluster.deploy.k8s.rayservice` assembles them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from cluster.config.keys import ApiKeySource
from cluster.config import ConfigError, RdserveConfig
from cluster.deploy.app_args import PROJECT_ROOT

IMAGE_PROJECT_DIR = PurePosixPath("/opt/rdserve")
"""Where k8s/Dockerfile puts the project (installed editable): the builder's project root in a pod."""

CACHE_DIR = "/var/cache/rdserve"
"""``RDSERVE_CACHE`` in the image: the default model, pulled at image build time, and the GEMM kernel."""

GCS_PORT, DASHBOARD_PORT, CLIENT_PORT = 6379, 8265, 10001
DASHBOARD_AGENT_PORT = 52365
"""Ray's dashboard agent (KubeRay's liveness and readiness probes, Serve's REST API) on every Ray pod."""
API_KEYS_SECRET_KEY = "keys"


def metrics_port(cfg: RdserveConfig) -> int:
    """Ray's metrics export port on every pod: ``observability.metrics_port`` (Ray's own and Serve's
    metrics are exported there whatever ``observability.enabled`` says)."""
    return cfg.observability.metrics_port


@dataclass(frozen=True)
class EnginePool:
    """One Kubernetes worker group: the engine replicas of one Serve deployment, one per pod."""

    group: str  # workerGroupSpecs[].groupName
    min_replicas: int
    max_replicas: int
    autoscaling: bool


def _bounds(replicas: int, scaling) -> tuple[int, int]:
    return (scaling.min_replicas, scaling.max_replicas) if scaling else (replicas, replicas)


def engine_pools(cfg: RdserveConfig) -> list[EnginePool]:
    """``engine`` (one pool), or ``engine-spec`` and ``engine-plain`` (``serve.pools``), each with the
    pod bounds of its Serve replicas: autoscaling's ``min_replicas``/``max_replicas``, or the fixed count."""
    pools = cfg.serve.pools
    if pools is None:
        lo, hi = _bounds(cfg.serve.replicas, cfg.serve.autoscaling)
        return [EnginePool("engine", lo, hi, cfg.serve.autoscaling is not None)]
    out = []
    for name, pool in (("spec", pools.spec), ("plain", pools.plain)):
        lo, hi = _bounds(pool.replicas, pool.autoscaling)
        out.append(EnginePool(f"engine-{name}", lo, hi, pool.autoscaling is not None))
    return out


def pod_path(path: Path) -> str:
    """Where ``path`` is in a pod: inside the project -> under :data:`IMAGE_PROJECT_DIR`; else unchanged."""
    path = Path(path)
    if path.is_relative_to(PROJECT_ROOT):
        return str(IMAGE_PROJECT_DIR / path.relative_to(PROJECT_ROOT).as_posix())
    return path.as_posix()


def pod_config(cfg: RdserveConfig) -> RdserveConfig:
    """``cfg`` as the pods run it, checked for what a pod cannot honour.

    Serve listens on ``0.0.0.0`` (the proxy is reached through a Service); a null ``engine.num_threads``
    becomes ``kubernetes.worker_cpus // engine.tp_size`` (each rank's torch threads: the pod's cores,
    not the node's, which a process in a container would see).

    Raises:
        ConfigError: API keys written in the config (they would be copied into the RayService: use
            ``{env: VAR}`` or ``{file: PATH}`` backed by a Secret); a fractional
            ``serve.num_cpus_per_replica`` or one above ``kubernetes.worker_cpus`` (a pod holds exactly
            one replica); a model/drafter directory (or calibration file) neither in the project nor under
            ``kubernetes.models_mount``, or under it without ``kubernetes.models_claim`` (nothing is
            mounted there); ``serve.api_keys.file`` on the read-only models volume; ``serve.port`` or
            ``observability.metrics_port`` on a port the pods already use; ``engine.device``
            naming a GPU index (``cuda:1``: a pod's engine replica sees only the GPUs Ray gave it, from
            ``cuda:0``).
    """
    k8s = cfg.kubernetes
    keys = cfg.serve.api_keys
    if keys is not None and not isinstance(keys, ApiKeySource):
        raise ConfigError("serve.api_keys: keys written in the config would be copied into the RayService "
                          "(readable by anyone who can read it); use {env: RDSERVE_API_KEYS} and the Secret "
                          "that `rdserve k8s render` references")
    cpus = cfg.serve.num_cpus_per_replica
    if cpus != math.floor(cpus):
        raise ConfigError(f"serve.num_cpus_per_replica: {cpus} is not a whole number; in Kubernetes each engine "
                          "pod advertises that many Ray CPUs so that it holds exactly one replica")
    if cpus > k8s.worker_cpus:
        raise ConfigError(f"kubernetes.worker_cpus: {k8s.worker_cpus} is fewer than serve.num_cpus_per_replica "
                          f"({cpus:g}); an engine replica would not fit its pod")
    for field, path in (("model.path", cfg.model.path), ("drafter.path", cfg.drafter.path),
                        *cfg.speculation.calibration_files().items()):
        if path is not None and not path.is_relative_to(PROJECT_ROOT) and \
                not PurePosixPath(path.as_posix()).is_relative_to(k8s.models_mount):
            raise ConfigError(f"{field}: {path} is neither in the project (copied into the image) nor under "
                              f"kubernetes.models_mount ({k8s.models_mount}, the models volume)")
        if path is not None and not path.is_relative_to(PROJECT_ROOT) and not k8s.models_claim:
            raise ConfigError(f"{field}: {path} is under kubernetes.models_mount ({k8s.models_mount}), but "
                              "kubernetes.models_claim is null: no volume is mounted there; name the "
                              "PersistentVolumeClaim holding it")
    keys_file = keys.file if isinstance(keys, ApiKeySource) else None
    if keys_file is not None and k8s.models_claim and \
            PurePosixPath(pod_path(keys_file)).is_relative_to(k8s.models_mount):
        raise ConfigError(f"serve.api_keys.file: {keys_file} is on the read-only models volume "
                          f"({k8s.models_mount}); the Secret is mounted at that path: choose one outside it")
    taken = {GCS_PORT: "Ray's GCS port", DASHBOARD_PORT: "Ray's dashboard port", CLIENT_PORT: "Ray Client's port",
             DASHBOARD_AGENT_PORT: "Ray's dashboard agent port"}
    for field, port in (("serve.port", cfg.serve.port), ("observability.metrics_port", metrics_port(cfg))):
        if port in taken:
            raise ConfigError(f"{field}: port {port} is already {taken[port]} in the Ray pods")
        taken[port] = field
    if cfg.engine.device.startswith("cuda:"):
        raise ConfigError(f"engine.device: {cfg.engine.device} names a GPU; in a pod each engine replica sees only "
                          "the GPUs Ray reserved for it (from cuda:0): use 'cuda'")
    engine = cfg.engine
    if engine.num_threads is None:
        engine = engine.model_copy(update={"num_threads": max(1, k8s.worker_cpus // engine.tp_size)})
    serve = cfg.serve.model_copy(update={"host": "0.0.0.0"})
    return cfg.model_copy(update={"engine": engine, "serve": serve})


def ray_cpus(cfg: RdserveConfig) -> str:
    """``num-cpus`` of an engine pod's Ray node: exactly one replica's (``serve.num_cpus_per_replica``)."""
    return str(int(cfg.serve.num_cpus_per_replica))


def gpus_per_pod(cfg: RdserveConfig) -> int:
    """GPUs of an engine pod: ``engine.tp_size`` on CUDA (one per rank), else 0."""
    return cfg.engine.tp_size if cfg.engine.device.startswith("cuda") else 0


def container_env(cfg: RdserveConfig, secret_name: str) -> list[dict]:
    """Environment of every Ray container: the cache dir, ``cluster.deploy.app.SERVE_ENV`` (Ray's processes
    read it at start, as under ``rdserve up``), and ``serve.api_keys``' variable from the Secret."""
    from cluster.deploy.app import SERVE_ENV

    env = [{"name": "RDSERVE_CACHE", "value": CACHE_DIR}]
    env += [{"name": k, "value": v} for k, v in sorted(SERVE_ENV.items())]
    keys = cfg.serve.api_keys
    if isinstance(keys, ApiKeySource) and keys.env is not None:
        env.append({"name": keys.env, "valueFrom": {"secretKeyRef": {"name": secret_name,
                                                                     "key": API_KEYS_SECRET_KEY}}})
    return env


def volumes(cfg: RdserveConfig, secret_name: str) -> tuple[list[dict], list[dict]]:
    """``(volumes, volumeMounts)`` of every Ray pod: ``/dev/shm`` in memory, the models claim (read-only)
    when set, and the API keys file from the Secret when ``serve.api_keys`` is ``{file: PATH}``."""
    k8s = cfg.kubernetes
    vols = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": k8s.shm_size}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if k8s.models_claim:
        vols.append({"name": "models", "persistentVolumeClaim": {"claimName": k8s.models_claim, "readOnly": True}})
        mounts.append({"name": "models", "mountPath": k8s.models_mount, "readOnly": True})
    keys = cfg.serve.api_keys
    if isinstance(keys, ApiKeySource) and keys.file is not None:
        # only the file (subPath): a directory mount would hide what else is there (/tmp, /etc, the project)
        vols.append({"name": "api-keys", "secret": {"secretName": secret_name,
                                                    "items": [{"key": API_KEYS_SECRET_KEY, "path": "keys"}]}})
        mounts.append({"name": "api-keys", "mountPath": pod_path(keys.file), "subPath": "keys", "readOnly": True})
    return vols, mounts
