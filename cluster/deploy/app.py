"""The Ray Serve application: OpenAI ingress -> engine replicas (one ``Engine`` each)."""

from __future__ import annotations

import os

from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingPolicy, RequestRouterConfig

from cluster.deploy.app_args import config_from_args
from cluster.config import RdserveConfig
from cluster.ingress.openai_api import INGRESS_MAX_ONGOING_REQUESTS, OpenAIIngress
from cluster.replica.placement import tp_placement_options
from cluster.replica.replica import EngineReplica

APP_NAME = "rdserve"
INGRESS_NAME = "OpenAIIngress"
ENGINE_NAME = "EngineReplica"

SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
             "RAY_worker_niceness": "0", "GOMP_SPINCOUNT": "10000"}
"""Environment rdserve gives Ray (``rdserve up``, where an operator's own value wins; Kubernetes pods;
the Serve config's ``runtime_env``, which overrides a pod's value for the workers):

- ``RAY_SERVE_THROUGHPUT_OPTIMIZED``: Ray Serve's throughput mode runs replica code on the replica's
  event loop instead of a second thread, talks gRPC between proxy and replicas, serves HTTP at the
  ingress replica directly and freezes start-up objects out of the garbage collector; every token of
  a stream crosses fewer threads and processes (``benchmarks/served_vs_engine.py``).
- ``RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE`` 1: throughput mode otherwise buffers a replica's log
  records 1,000 at a time (written at ERROR or when full), so ``logs/serve/replica_*.log`` stayed
  empty while serving: the start-up lines an operator reads (the speculation policy and which field
  chose it, a calibration not trusted here) appeared only at shutdown. Replicas log about a line
  per request (Serve's access line), not per token, so each record is written as it comes.
- ``RAY_worker_niceness`` 0: Ray starts its workers (the engine replicas, the ingress, Serve's proxy)
  at niceness 15 by default, so anything at the default priority, a load generator or a sidecar,
  takes ~28x their CPU share, and even a ``nice -n 19`` loop competes with them as a near equal
  (weights 36 and 15). At 0 the serving processes share cores as ordinary processes do, Ray's own
  daemons (raylet, GCS) included. Read by the raylet, so it takes effect from the environment Ray
  starts in (``rdserve up``, the pods); in a Serve config's ``runtime_env`` it does nothing.
- ``GOMP_SPINCOUNT``: how long an idle OpenMP thread (the engine's kernels and torch's) spins before it
  sleeps. libgomp's default, 300,000 pause loops, is several milliseconds: a thread waiting at a
  barrier for a preempted team mate keeps its core busy, so the preempted thread cannot move there,
  and between steps the spinning threads take the cores the ingress and the event loop need.
  10,000 (a fraction of a millisecond) still covers the gaps between kernels inside a step
  (``benchmarks/contention.py`` measures the choices). Read when the OpenMP runtime loads, so it
  must be in the process's environment at start (the workers inherit it from Ray's or get it from
  the Serve config's ``runtime_env``)."""


def local_serve_env(port: int) -> dict[str, str]:
    """What ``rdserve up`` adds to :data:`SERVE_ENV` on one machine.

    - Direct ingress on ``serve.port``: the ingress replica runs the HTTP server itself (Ray Serve's
      ``RAY_SERVE_ENABLE_DIRECT_INGRESS``, its port range narrowed to ``[port, port + 1)``); Serve's
      proxy moves to a free port. A request skips the proxy's process and one Ray call each way
      (about 9 ms of time to first token on 2 cores). Kubernetes keeps Serve's proxies, which
      KubeRay's Service selects.
    - A stopping ingress replica stays reachable 2 s (Serve's default 30 s, for load balancers to
      deregister it): ``rdserve up`` has drained it already (``cluster.ingress.drain``).
    """
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


def engine_actor_options(cfg: RdserveConfig) -> dict:
    """Ray resources of one engine replica: ``serve.num_cpus_per_replica`` CPUs, plus one GPU (chosen by Ray)
    for a CUDA device: rank 0's; with ``engine.tp_size`` > 1 the other ranks' GPUs are placement-group
    bundles (``cluster.replica.placement``)."""
    return {"num_cpus": cfg.serve.num_cpus_per_replica, "num_gpus": 1 if cfg.engine.device.startswith("cuda") else 0}


def replacement_options(cfg: RdserveConfig) -> dict:
    """How replicas are stopped and replaced. With autoscaling: a replica being stopped (scale-down,
    redeploy) first finishes its streams, for at most ``graceful_shutdown_timeout_s``; a redeploy starts
    each replacement before stopping the replica it replaces (``max_surge_percent`` 100; every
    ``serve.run`` of a Python application is a new code version to Serve, so it replaces every replica).
    Without autoscaling: ``serve.drain_timeout_s`` to finish streams, stop first."""
    scaling = cfg.serve.autoscaling
    if scaling is None:
        return {"graceful_shutdown_timeout_s": cfg.serve.drain_timeout_s, "graceful_shutdown_wait_loop_s": 1.0}
    return {"graceful_shutdown_timeout_s": scaling.graceful_shutdown_timeout_s,
            "graceful_shutdown_wait_loop_s": 1.0,  # how often a stopping replica checks for finished streams
            "max_surge_percent": 100}


def replica_count_options(cfg: RdserveConfig) -> dict:
    """``num_replicas`` for a fixed count, or Serve's ``autoscaling_config`` with the rdserve policy
    (``cluster.routing.autoscaling``)."""
    scaling = cfg.serve.autoscaling
    if scaling is None:
        return {"num_replicas": cfg.serve.replicas}
    policy = AutoscalingPolicy(
        policy_function="cluster.routing.autoscaling:RdserveAutoscalingPolicy",
        policy_kwargs={"target_ongoing_requests": scaling.target_ongoing_requests,
                       "kv_usage_target": scaling.kv_usage_target,
                       "slo_ttft_s": scaling.slo_ttft_ms / 1000 if scaling.slo_ttft_ms else None},
    )
    bounds = scaling.model_dump(include={"min_replicas", "max_replicas", "target_ongoing_requests",
                                         "upscale_delay_s", "downscale_delay_s", "look_back_period_s",
                                         "metrics_interval_s"})
    return {"autoscaling_config": {**bounds, "policy": policy}}


ROUTING_STATS_PERIOD_S = 0.5
"""How often Serve polls each engine replica's ``record_routing_stats`` (Serve's default is 10 s; the
goodput router ranks on these stats, and counts what it sent since for the time between polls)."""

ROUTING_STATS_TIMEOUT_S = 5.0


def request_router_options(cfg: RdserveConfig) -> dict:
    """``request_router_config`` of the engine replicas: ``serve.request_router`` 'goodput'
    (``cluster.routing.request_router``, ``serve.prefix_aware_routing`` its ``prefix_aware``) or 'pow2'
    (Serve's default router), both polling routing stats every ``ROUTING_STATS_PERIOD_S``."""
    router_class = ({"request_router_class": "cluster.routing.request_router:GoodputRequestRouter",
                     "request_router_kwargs": {"prefix_aware": cfg.serve.prefix_aware_routing}}
                    if cfg.serve.request_router == "goodput" else {})
    return {"request_router_config": RequestRouterConfig(
        **router_class, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        request_routing_stats_timeout_s=ROUTING_STATS_TIMEOUT_S)}


def pool_configs(cfg: RdserveConfig) -> dict[str, RdserveConfig]:
    """Two-pool mode (``serve.pools``, :mod:`cluster.ingress.pools`): the config of each pool's replicas.

    ``spec``: the drafter, speculation.num_beams x draft_len_per_beam at every batch size, every request
    drafts. ``plain``: no drafter. Each pool has its own replicas or autoscaling; a null
    ``engine.num_threads`` shares the cores among the most replicas both pools may run together.
    """
    pools = cfg.serve.pools
    most = sum(p.autoscaling.max_replicas if p.autoscaling else p.replicas for p in (pools.spec, pools.plain))
    engine = cfg.engine.model_copy(update={"num_threads": cfg.engine.num_threads or max(1, (os.cpu_count() or 1) // most)})
    out = {}
    for name, pool in (("spec", pools.spec), ("plain", pools.plain)):
        serve_cfg = cfg.serve.model_copy(update={"replicas": pool.replicas, "autoscaling": pool.autoscaling, "pools": None})
        drafter = cfg.drafter if name == "spec" else cfg.drafter.model_copy(update={"path": None})
        spec = cfg.speculation.model_copy(update={"default_mode": name, "calibration": None})  # the ingress reads it
        out[name] = cfg.model_copy(update={"engine": engine, "drafter": drafter, "speculation": spec, "serve": serve_cfg})
    return out


HEALTH_CHECK_PERIOD_S = 2.0
"""How often Serve calls each engine replica's ``check_health`` (an attribute read; Serve's default is
10 s). Serve replaces a replica after 3 failed checks in a row, so one whose TP rank died is replaced
after about 6 s instead of 30 s (measured with the tiny model: a new request succeeded 47 s after the
kill with the default, ``tests/cluster/test_faults_ray.py``)."""


def _engine_deployment(cfg: RdserveConfig, name: str = ENGINE_NAME):
    return EngineReplica.options(
        name=name,
        **replica_count_options(cfg),
        **replacement_options(cfg),
        **request_router_options(cfg),
        **tp_placement_options(cfg),
        ray_actor_options=engine_actor_options(cfg),
        max_ongoing_requests=cfg.serve.max_ongoing_requests,
        max_queued_requests=cfg.serve.max_queued_requests or -1,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    ).bind(cfg)


def engine_deployment_name(cfg: RdserveConfig) -> str:
    """The Serve deployment whose replicas hold the engine in one-pool mode: the ingress when colocated
    (``serve.colocate``), else ``EngineReplica`` (its handle answers ``stats``, ``processes``...)."""
    return INGRESS_NAME if cfg.serve.colocated(cfg.engine.tp_size) else ENGINE_NAME


def _colocated_deployment(cfg: RdserveConfig):
    """The ingress with the engine in its process (:mod:`cluster.replica.colocated`): the engine replica's
    resources, health probe and stop/replace options; Serve's own queue limit stays the ingress's, and
    ``serve.max_ongoing_requests``/``max_queued_requests`` apply at the engine (``InProcessClient``)."""
    from cluster.replica.colocated import ColocatedIngress

    return serve.deployment(ColocatedIngress, name=INGRESS_NAME).options(
        num_replicas=1,
        **replacement_options(cfg),
        ray_actor_options=engine_actor_options(cfg),
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    ).bind(cfg)


def build_app(cfg: RdserveConfig) -> Application:
    """Bind the deployments for ``cfg``; ``serve.run(build_app(cfg))`` deploys them.

    One engine replica (``serve.colocate``, :meth:`ServeConfig.colocated`): ``OpenAIIngress`` with the
    engine in its process. One pool: ingress -> ``EngineReplica``. Two-pool mode: ingress ->
    ``EngineReplicaSpec`` and ``EngineReplicaPlain`` (see :func:`pool_configs`); the ingress picks the
    pool per request.
    """
    if cfg.serve.colocated(cfg.engine.tp_size):
        return _colocated_deployment(cfg)
    if cfg.serve.pools is None:
        engine = _engine_deployment(cfg)
        return OpenAIIngress.options(**replacement_options(cfg)).bind(engine, cfg.model.name, serve_cfg=cfg.serve)
    pools = {name: _engine_deployment(pcfg, f"{ENGINE_NAME}{name.title()}") for name, pcfg in pool_configs(cfg).items()}
    policy = {"calibration": str(cfg.speculation.calibration),
              "shape": [cfg.speculation.num_beams, cfg.speculation.draft_len_per_beam]}
    scaling = cfg.serve.pools.spec.autoscaling or cfg.serve.pools.plain.autoscaling
    ingress_cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"autoscaling": scaling})})
    return OpenAIIngress.options(**replacement_options(ingress_cfg)).bind(pools, cfg.model.name, policy, serve_cfg=cfg.serve)


def app_builder(args: dict) -> Application:
    """Application builder for Ray's declarative Serve config (``import_path: cluster.deploy.app:app_builder``:
    ``serve run``, ``serve deploy``, KubeRay ``serveConfigV2``): ``args`` is ``{"config": {...}}`` (the
    rdserve config inline) or ``{"config_path": "configs/local.yaml"}``; relative paths resolve against
    the project root (:func:`cluster.deploy.app_args.config_from_args`). Returns what ``rdserve up`` deploys.

    Raises:
        ConfigError: bad ``args`` or config, naming the field.
    """
    return build_app(config_from_args(args))


def deploy(cfg: RdserveConfig, name: str = APP_NAME, route_prefix: str = "/") -> None:
    """Deploy on a running Serve instance and wait until the replicas are up."""
    serve.run(build_app(cfg), name=name, route_prefix=route_prefix)
