"""Loopback ports for the servers a benchmark starts."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000  # above the registered ports most local services use


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux: ``ip_local_port_range``; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port number on 127.0.0.1 that was free when asked (nothing holds it after).

    Chosen below the kernel's ephemeral range: a port the OS picks (``bind`` to 0) lies inside it, where
    every outgoing connection takes its local port, and a server started seconds later (Ray opens many
    connections meanwhile) found one taken (``rdserve up``'s direct ingress: ``NoAvailablePortError``).
    Falls back to the OS's pick when no port below the range is free."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100 if low > LOWEST + 100 else 0):
        port = rng.randrange(LOWEST, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
