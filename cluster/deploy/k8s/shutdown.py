"""How the pods of an rdserve RayService stop without cutting streams: in a zero-downtime upgrade, a
scale-down, a node drain. Long completions are what KubeRay issue #4126 asks to survive an upgrade;
Ray issue #64181: SIGTERM to ``ray start --block`` (PID 1 of a Ray container) killed the replicas while
the proxies still routed to them.

From the outside in:

- **Upgrade** (``spec.upgradeStrategy: NewCluster``, KubeRay's blue/green): KubeRay starts a new
  RayCluster, points the ``serveService`` at it once its Serve application is healthy, and deletes the
  old cluster ``rayClusterDeletionDelaySeconds`` later (KubeRay's default: 60 s). Streams that began on
  the old cluster keep their connections to its proxies; the delay is :attr:`PodShutdown.drain_s`, so
  each has as long to finish as when Serve stops a replica.
- **A pod stops**: the ``preStop`` hook sleeps :data:`PRESTOP_S`, so the pod leaves the Services'
  endpoints before Ray hears SIGTERM; then ``ray start`` marks its node draining and waits up to
  ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` (:attr:`PodShutdown.drain_s`) while Serve moves the
  node's replicas away, each finishing its streams for its deployment's ``graceful_shutdown_timeout_s``.
  Not ``ray stop`` as a preStop hook (older KubeRay samples): it kills the raylet at once, skipping
  the drain.
- **Grace period**: ``terminationGracePeriodSeconds`` covers the hook, the drain and
  :data:`TEARDOWN_S` for Ray to stop its processes; Kubernetes' default 30 s would SIGKILL mid-drain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.config import RdserveConfig

PRESTOP_S = 5
"""The preStop sleep: for the endpoint removal to reach kube-proxy and load balancers."""
TEARDOWN_S = 30
"""After the drain, for ``ray start`` to stop the raylet and the workers (SIGTERM, then SIGKILL)."""
SERVE_DEFAULT_GRACEFUL_SHUTDOWN_S = 20.0
"""Serve's ``graceful_shutdown_timeout_s`` for a deployment that sets none."""
DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"


@dataclass(frozen=True)
class PodShutdown:
    """``drain_s``: how long a stopping pod (or an old cluster after an upgrade) lets streams finish."""

    drain_s: int

    @property
    def grace_s(self) -> int:
        """``terminationGracePeriodSeconds``: preStop sleep + drain + teardown."""
        return PRESTOP_S + self.drain_s + TEARDOWN_S

    def env(self) -> list[dict]:
        """The Ray containers' drain on SIGTERM."""
        return [{"name": DRAIN_ENV, "value": str(self.drain_s)}]

    def lifecycle(self) -> dict:
        """The Ray containers' ``lifecycle``: ``sleep`` run by an exec hook (the ``sleep`` action needs
        Kubernetes >= 1.30; older API servers reject a preStop without a handler they know)."""
        return {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_S)]}}}

    def upgrade(self) -> dict:
        """The RayService ``spec`` fields of a zero-downtime upgrade."""
        return {"upgradeStrategy": {"type": "NewCluster"}, "rayClusterDeletionDelaySeconds": self.drain_s}


def pod_shutdown(cfg: RdserveConfig, deployments: list[dict]) -> PodShutdown:
    """The shutdown of pods running ``deployments`` (``serveConfigV2``'s entries): the longest
    ``graceful_shutdown_timeout_s`` among them (Serve's 20 s where unset) or ``serve.drain_timeout_s``,
    whichever is longer, in whole seconds."""
    longest = max((d.get("graceful_shutdown_timeout_s", SERVE_DEFAULT_GRACEFUL_SHUTDOWN_S) for d in deployments),
                  default=SERVE_DEFAULT_GRACEFUL_SHUTDOWN_S)
    return PodShutdown(math.ceil(max(longest, cfg.serve.drain_timeout_s)))
