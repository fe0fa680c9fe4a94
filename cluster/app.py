"""The Ray Serve application: OpenAI ingress -> engine replicas (one ``Engine`` each)."""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from cluster.config import RdserveConfig
from cluster.openai_api import OpenAIIngress
from cluster.replica import EngineReplica

APP_NAME = "rdserve"

def engine_actor_options(cfg: RdserveConfig) -> dict:
    """Ray resources of one engine replica: one CPU, plus one GPU (chosen by Ray) for a CUDA device."""
    return {"num_cpus": 1, "num_gpus": 1 if cfg.engine.device.startswith("cuda") else 0}


def build_app(cfg: RdserveConfig) -> Application:
    """Bind the deployments for ``cfg``; ``serve.run(build_app(cfg))`` deploys them."""
    engine = EngineReplica.options(
        num_replicas=cfg.serve.replicas,
        ray_actor_options=engine_actor_options(cfg),
        max_ongoing_requests=cfg.serve.max_ongoing_requests,
        max_queued_requests=cfg.serve.max_queued_requests or -1,
    ).bind(cfg)
    return OpenAIIngress.bind(engine, cfg.model.name)


def deploy(cfg: RdserveConfig, name: str = APP_NAME, route_prefix: str = "/") -> None:
    """Deploy on a running Serve instance and wait until the replicas are up."""
    serve.run(build_app(cfg), name=name, route_prefix=route_prefix)
