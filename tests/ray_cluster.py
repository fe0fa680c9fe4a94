"""A Ray head node of its own for a test: ``ray start --head --block`` in a subprocess, on free ports,
with its own temp dir and auth token, so it collides neither with the pytest session's Ray instance nor
with other clusters on the machine. Stopped by its own processes only (never ``ray stop``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

PORT_FLAGS = ("--port", "--dashboard-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
              "--runtime-env-agent-port", "--metrics-export-port", "--node-manager-port", "--object-manager-port")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago (held together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class RayHead:
    """A running head node: ``address`` (GCS), ``dashboard`` (URL of the REST API ``serve deploy`` uses),
    ``env`` (what a client process needs: the auth token), ``temp_dir``."""

    process: subprocess.Popen
    address: str
    dashboard: str
    env: dict
    temp_dir: Path
    log: Path

    def own_pids(self) -> list[int]:
        """Processes of this cluster: every process whose command line names its temp dir."""
        pids = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if str(self.temp_dir).encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
        return [p for p in pids if p != os.getpid()]

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM the blocking ``ray start`` (it stops what it started), then SIGKILL what is left of
        this cluster's processes."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        deadline = time.monotonic() + 10
        while self.own_pids() and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in self.own_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_head(num_cpus: int = 4, num_gpus: int = 0, env: dict | None = None, timeout_s: float = 240.0) -> RayHead:
    """Start a head node with the dashboard (Serve's REST API), ``num_gpus`` logical GPUs (Ray needs no
    real GPU to schedule them) and ``env`` added to its processes' environment.

    Raises:
        RuntimeError: the dashboard did not answer within ``timeout_s`` (the log's tail is in the message).
    """
    temp_dir = Path(tempfile.mkdtemp(prefix="rdray-", dir="/tmp"))  # short: Ray's socket paths are length-limited
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
    token = secrets.token_hex(32)
    client_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    full_env = {**os.environ, **(env or {}), **client_env}
    ray_bin = str(Path(sys.executable).parent / "ray")
    cmd = [ray_bin, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1",
           "--include-dashboard", "true", "--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus),
           "--object-store-memory", str(100 * 2**20), "--min-worker-port", "0", "--max-worker-port", "0",
           "--temp-dir", str(temp_dir), "--disable-usage-stats"]
    for flag, port in ports.items():
        cmd += [flag, str(port)]
    log = temp_dir / "ray-start.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    head = RayHead(process, f"127.0.0.1:{ports['--port']}", f"http://127.0.0.1:{ports['--dashboard-port']}",
                   client_env, temp_dir, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            if httpx.get(f"{head.dashboard}/api/version", timeout=5,
                         headers={"Authorization": f"Bearer {token}"}).status_code == 200:
                return head
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    tail = log.read_text(errors="replace")[-3000:]
    head.stop()
    raise RuntimeError(f"Ray head did not start within {timeout_s:.0f} s:\n{tail}")


def stop_process_group(proc) -> None:
    """SIGINT to the process group of ``proc`` (``rdserve up`` started with ``start_new_session``), then
    SIGKILL if it has not exited within 90 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def read_all(f) -> str:
    """Everything written so far to the temporary file ``f``."""
    f.seek(0)
    return f.read()


def start_rdserve_up(config: Path, temp_dir: Path, timeout_s: float = 300.0,
                     cwd: Path | None = None) -> tuple[subprocess.Popen, tempfile.TemporaryFile]:
    """A running ``rdserve up --config config`` (its own Ray under ``temp_dir``, its own process group),
    once it printed that it is up, and the file its output goes to. Stop it with ``stop_process_group``.

    Raises:
        RuntimeError: it exited or was not up within ``timeout_s`` (its output's tail is in the message).
    """
    out = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("rdserve")), "up", "--config", str(config)], cwd=cwd,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "COLUMNS": "200", "RAY_TMPDIR": str(temp_dir)})
    deadline = time.monotonic() + timeout_s
    while "rdserve is up" not in read_all(out):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process_group(proc)
            raise RuntimeError(f"rdserve up did not start:\n{read_all(out)[-3000:]}")
        time.sleep(1)
    return proc, out
