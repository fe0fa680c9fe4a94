"""``rdserve up`` on one machine (cluster.deploy.local_ray): every listener of its process tree on loopback unless
the config opens it, and a port that only closed connections hold (TIME-WAIT, FIN-WAIT) is free at once,
while one that something listens on is refused. The ``rdserve up`` tests run real processes, each with its
own Ray (about 40 s a start on 2 cores)."""

from __future__ import annotations

import ipaddress
import re
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
from ray_cluster import read_all, start_rdserve_up, stop_process_group

from cluster.config import parse_config
from cluster.deploy.local_ray import (LOCAL_RAY_ENV, listening, loopback_only, port_in_use, port_state,
                               ray_init_options, wait_while_closing)

REPO = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = 300


def _listening_port(reuse_address: bool = True, port: int = 0) -> tuple[socket.socket, int]:
    server = socket.socket()
    if reuse_address:  # as uvicorn, Serve's proxy and Ray's metrics agent bind (Serve's direct ingress does not)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    return server, server.getsockname()[1]


def _states(port: int) -> set[str]:
    return {c.status for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port}


def _served_and_stopped(reuse_address: bool, port: int = 0) -> tuple[socket.socket, int]:
    """A port (``port``, or any free one) whose server closed while its client stays connected
    (FIN-WAIT-2 on the port); the client."""
    server, port = _listening_port(reuse_address, port)
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()
    server.close()
    return client, port


def test_a_port_held_only_by_closed_connections_is_free_at_once():
    client, port = _served_and_stopped(reuse_address=True)
    assert port_in_use(port) is False and port_state(port) == "free", _states(port)
    client.close()  # and now TIME-WAIT, for 60 s
    time.sleep(0.1)
    assert psutil.CONN_TIME_WAIT in _states(port) and psutil.CONN_LISTEN not in _states(port)
    assert port_in_use(port) is False and port_state(port) == "free"
    assert port_state(port, reuse_address=False) == "closing"  # a server binding without SO_REUSEADDR must wait


def test_closed_connections_of_a_server_without_reuse_address_hold_its_port_a_while():
    client, port = _served_and_stopped(reuse_address=False)
    with client:
        assert port_state(port) == "closing" and port_state(port, reuse_address=False) == "closing"
        started = time.monotonic()
        assert wait_while_closing(port, timeout_s=0.3, poll_s=0.1) == "closing"
        assert time.monotonic() - started < 2


def test_a_port_something_listens_on_is_in_use():
    for reuse_address in (True, False):
        server, port = _listening_port(reuse_address)
        with server:
            assert port_in_use(port) and port_in_use(port, reuse_address=False)
            assert port_state(port) == port_state(port, reuse_address=False) == "listening"
            assert wait_while_closing(port) == "listening"  # at once
    with socket.socket(socket.AF_INET6) as v6:  # a listener the IPv4 bind does not see is found too
        v6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        v6.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        v6.bind(("::1", 0))
        v6.listen()
        assert listening(v6.getsockname()[1])


def test_local_ray_stays_on_loopback_unless_metrics_host_opens_it(tmp_path):
    local = parse_config({}, tmp_path)
    assert local.observability.metrics_host == "127.0.0.1" and loopback_only(local)
    assert ray_init_options(local) == {"include_dashboard": False, "_metrics_export_port": 8080,
                                       "_node_ip_address": "127.0.0.1"}
    assert LOCAL_RAY_ENV == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    head = parse_config({"observability": {"metrics_host": "0.0.0.0", "metrics_port": 9100}}, tmp_path)
    assert not loopback_only(head)
    assert ray_init_options(head) == {"include_dashboard": False, "_metrics_export_port": 9100}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _up(config: Path, temp_dir: Path) -> tuple[subprocess.Popen, tempfile.TemporaryFile]:
    """A running ``rdserve up --config config`` (its Ray under ``temp_dir``), once it printed that it is up."""
    try:
        return start_rdserve_up(config, temp_dir, START_TIMEOUT_S, cwd=REPO)
    except RuntimeError as err:
        pytest.fail(str(err))


_stop, _read = stop_process_group, read_all


def _listeners(proc: subprocess.Popen, temp_dir: Path) -> list[tuple[str, str, int]]:
    """``(process name, address, port)`` of every listening TCP socket and bound UDP socket of ``proc``'s
    process tree and of every process of its Ray (named by ``temp_dir`` on its command line)."""
    root = psutil.Process(proc.pid)
    procs = {p.pid: p for p in [root, *root.children(recursive=True)]}
    for p in psutil.process_iter(["cmdline"]):
        if str(temp_dir) in " ".join(p.info["cmdline"] or []):
            procs.setdefault(p.pid, p)
    found = []
    for p in procs.values():
        try:
            name = " ".join(p.cmdline()[:1]) or p.name()
            for c in p.net_connections("inet"):
                if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr):
                    found.append((name, c.laddr.ip, c.laddr.port))
        except psutil.Error:  # a worker that exited meanwhile
            continue
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def _config(tiny_config_path: Path, name: str, port: int, metrics_port: int) -> Path:
    config = tiny_config_path.parent / name
    config.write_text(tiny_config_path.read_text() + f"serve: {{host: 127.0.0.1, port: {port}}}\n"
                      f"observability: {{metrics_port: {metrics_port}}}\n")
    return config


def test_up_keeps_every_listener_on_loopback(tiny_config_path):
    port, metrics_port = _free_port(), _free_port()
    config = _config(tiny_config_path, "loopback.yaml", port, metrics_port)
    temp_dir = Path(tempfile.mkdtemp(prefix="rdlo-", dir="/tmp"))  # short: Ray's socket paths are length-limited
    proc, out = _up(config, temp_dir)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
        listeners = _listeners(proc, temp_dir)
        ports = {p for _, _, p in listeners}
        assert {port, metrics_port} <= ports, (listeners, _read(out)[-2000:])
        assert len(listeners) >= 6, listeners  # GCS, raylet, agents, workers: the tree was seen
        exposed = [entry for entry in listeners if not _loopback(entry[1])]
        # The one exception: each Serve replica's inter-deployment gRPC server, which Ray Serve binds to
        # "[::]:0" in code (ray/serve/_private/replica.py, Replica._on_initialized) with no setting to
        # change it; Ray's token authentication (on by default for a local Ray of this version) guards it.
        replicas = [entry for entry in exposed if entry[0].startswith("ray::ServeReplica:") and entry[1] == "::"]
        assert len({name for name, _, _ in replicas}) == len(replicas) == 1, exposed
        assert [entry for entry in exposed if entry not in replicas] == [], f"listening beyond loopback: {exposed}"
    finally:
        _stop(proc)


def test_up_starts_again_after_serving_clients(tiny_config_path):
    """Connections of the stopped server linger on both ports; the metrics port is free at once, and
    ``serve.port`` (Serve's direct ingress binds it without SO_REUSEADDR) is waited for, not refused.

    The kernel keeps the stopped server's own closed connections 60 s (TIME-WAIT after the metrics
    server's close, FIN-WAIT-2 after the proxy's), which a slow stop can outlast (CI once saw both gone),
    so where they are gone the test leaves a closed connection of its own on the port once the server has
    stopped: the restart meets held ports every time."""
    port, metrics_port = _free_port(), _free_port()
    config = _config(tiny_config_path, "restart.yaml", port, metrics_port)
    temp_dir = Path(tempfile.mkdtemp(prefix="rdre-", dir="/tmp"))
    proc, out = _up(config, temp_dir)
    with httpx.Client(timeout=60) as client:  # keep-alive connections, open across the shutdown (as Prometheus')
        try:
            assert client.get(f"http://127.0.0.1:{port}/health").status_code == 200
            assert client.get(f"http://127.0.0.1:{metrics_port}/metrics").status_code == 200
        finally:
            _stop(proc)
        assert proc.returncode == 0, _read(out)[-2000:]
        held = [_served_and_stopped(reuse_address=True, port=p)[0] for p in (port, metrics_port) if not _states(p)]
        for p in (port, metrics_port):  # closed connections hold the ports, nothing listens
            assert _states(p) and psutil.CONN_LISTEN not in _states(p), (p, _states(p))
        assert port_state(metrics_port) == "free"
        assert port_state(port, reuse_address=False) == "closing"
    try:
        proc, out = _up(config, temp_dir)
        _stop(proc)
    finally:
        for c in held:
            c.close()
    assert "in use" not in _read(out)
