"""Replica counts per pool, as Ray Serve's controller reports them (for ``GET /health``).

A pool is one deployment of engine replicas (``engine``: ``EngineReplica``, or ``OpenAIIngress`` when the
engine runs in the ingress, ``serve.colocate``; ``spec``/``plain`` in two-pool mode). The counts come
from the controller's ``get_serve_instance_details``, the call behind ``serve status`` and the
dashboard's REST API, whose ``ServeInstanceDetails`` schema (``ray.serve.schema``) is public; reaching
the controller by its actor name uses Serve 2.60's private constants.
"""

from __future__ import annotations

import asyncio
import functools

REPLICA_STATES = {"running": "RUNNING", "starting": "STARTING", "stopping": "STOPPING"}


def pool_counts(details: dict, app_name: str, pools: dict[str, str]) -> dict[str, dict]:
    """``{pool: {"running", "starting", "stopping", "target"}}`` from a ``ServeInstanceDetails`` dict.

    ``pools`` maps a pool name to its deployment name in ``app_name``; a pool whose deployment is
    not (yet) in ``details`` gets zero counts.
    """
    deployments = details.get("applications", {}).get(app_name, {}).get("deployments", {})
    out = {}
    for pool, deployment_name in pools.items():
        deployment = deployments.get(deployment_name, {})
        states = [r.get("state") for r in deployment.get("replicas", [])]
        out[pool] = {key: states.count(state) for key, state in REPLICA_STATES.items()}
        out[pool]["target"] = deployment.get("target_num_replicas", 0)
    return out


@functools.cache
def _controller():
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


async def replica_counts(app_name: str, pools: dict[str, str], timeout_s: float) -> dict[str, dict] | None:
    """:func:`pool_counts` for the running Serve instance; None when the controller does not answer
    within ``timeout_s`` seconds (or cannot be reached). Call it from a deployment or a driver
    connected to Ray; it never blocks the event loop."""
    try:
        details = await asyncio.wait_for(_controller().get_serve_instance_details.remote(), timeout_s)
    except Exception:  # a health probe reports what it can; the engine's own answer decides the status
        return None
    return pool_counts(details, app_name, pools)
