"""How ``rdserve up`` starts Ray on one machine: its listeners on loopback, and the check of its ports.

Ray binds all of a node's listeners by one setting, the node's IP address: on a loopback address its
GCS, raylet, workers, dashboard and runtime-env agents and metrics agent listen on loopback only; on any
other address, on every interface (metrics agent: ``0.0.0.0``) or on that address (runtime-env agent).
``ray.init(_node_ip_address="127.0.0.1")`` alone is not enough: Ray replaces a loopback address by the
machine's external one (``ray._private.services.resolve_ip_for_localhost``) unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is ``0``, Ray's own single-machine mode (its default on macOS and
Windows). So ``rdserve up`` sets that and the loopback address unless ``observability.metrics_host``
opens the node (a head that Prometheus or other nodes reach); Ray has no way to open the metrics port
alone. Serve's HTTP address is ``serve.host``, independent of the node's: ``serve.host: 0.0.0.0`` serves
the API (and ``/metrics``, which proxies the metrics agent) on every interface while Ray stays on loopback.

The ports rdserve names (``serve.port``, ``observability.metrics_port``) are checked before Ray starts:
one that something listens on is refused at once; one that only a stopped server's closed connections
hold (TIME-WAIT, FIN-WAIT) is free at once where its server binds with ``SO_REUSEADDR``, and is waited
for (at most a minute) where it does not (Serve's direct ingress on ``serve.port``).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Literal

import psutil

from cluster.config import RdserveConfig

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Environment of a loopback-only Ray (set before ``ray.init``, which its processes inherit): Ray keeps a
loopback node address instead of replacing it by the machine's external address."""


def keep_ray_on_loopback() -> None:
    """Make this process's ``ray.init`` keep a loopback node address, and so Ray's processes (which
    inherit :data:`LOCAL_RAY_ENV`). Ray reads the variable into ``ray._private.ray_constants`` when
    ``ray`` is imported, which the CLI has done already: the constant is set as well."""
    from ray._private import ray_constants

    os.environ.update(LOCAL_RAY_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False


def loopback_only(cfg: RdserveConfig) -> bool:
    """Whether Ray's node listens on loopback only (``observability.metrics_host`` a loopback address)."""
    return cfg.observability.metrics_host in LOOPBACK_HOSTS


def ray_init_options(cfg: RdserveConfig) -> dict:
    """Keyword arguments of ``ray.init`` for ``rdserve up`` (no dashboard: nothing serves its port).

    With :func:`loopback_only`, the node's address is ``127.0.0.1``; it holds only after
    :func:`keep_ray_on_loopback`. Otherwise Ray chooses the machine's address.
    """
    options = {"include_dashboard": False, "_metrics_export_port": cfg.observability.metrics_port}
    if loopback_only(cfg):
        options["_node_ip_address"] = "127.0.0.1"
    return options


PORT_LINGER_S = 90.0
"""Longest wait for a stopped server's closed connections to release its port: TIME-WAIT and an orphaned
FIN-WAIT-2 last 60 s each on Linux (``tcp_fin_timeout``), plus a margin."""


def port_in_use(port: int, reuse_address: bool = True, host: str = "") -> bool:
    """True when ``port`` cannot be bound on ``host`` (default: every interface) the way its server binds.

    ``reuse_address``: the server sets ``SO_REUSEADDR`` (uvicorn, Serve's proxy, Ray's metrics agent): then
    only a listening socket holds the port, not the connections a stopped server left in TIME-WAIT or
    FIN-WAIT (for 60 s after it served clients or a scrape). Serve's direct ingress binds without it, so
    any socket on the port holds it, those connections too.
    """
    with socket.socket() as s:
        if reuse_address:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def listening(port: int) -> bool:
    """True when a TCP socket of this machine listens on ``port`` (any address, any process); also when
    the sockets cannot be listed (without privileges on macOS): then the port counts as taken."""
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in psutil.net_connections("tcp"))
    except psutil.AccessDenied:
        return True


def port_state(port: int, reuse_address: bool = True) -> Literal["free", "listening", "closing"]:
    """``free`` to bind as the server will (see :func:`port_in_use`); ``listening``: something serves on
    it; ``closing``: only closed connections of a stopped server hold it, for at most :data:`PORT_LINGER_S`."""
    if not port_in_use(port, reuse_address):
        return "free"
    return "listening" if listening(port) else "closing"


def wait_while_closing(port: int, reuse_address: bool = True, timeout_s: float = PORT_LINGER_S,
                       poll_s: float = 0.5) -> Literal["free", "listening", "closing"]:
    """:func:`port_state` once it is no longer ``closing``, or after ``timeout_s`` (then ``closing``)."""
    deadline = time.monotonic() + timeout_s
    while (state := port_state(port, reuse_address)) == "closing" and time.monotonic() < deadline:
        time.sleep(poll_s)
    return state
