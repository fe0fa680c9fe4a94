"""Loopback ports for the servers a benchmark starts."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port number on 127.0.0.1 that was free when asked (the OS picks it; nothing holds it after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
