"""Finding Prometheus's binaries for tests: skip with a clear reason when they are missing, or fail
when ``RDSERVE_REQUIRE_PROMETHEUS=1`` (``make test`` sets it after installing Debian's ``prometheus``)."""

import os
import shutil

import pytest


def prometheus_binary(name: str) -> str:
    """Path of ``name`` (``prometheus`` or ``promtool``), or skip/fail saying how to install it."""
    path = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if path is None:
        message = (f"{name} not found: this test needs Prometheus (Debian/Ubuntu: sudo apt-get install -y "
                   "prometheus; `make test` installs it)")
        if os.environ.get("RDSERVE_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path
