"""The default model served for the ingress tests that need a real model (``smollm``)."""

from pathlib import Path

import pytest
from openai import OpenAI
from ray import serve

from cluster.config import load_config
from cluster.deploy.app import deploy

LOCAL = Path(__file__).resolve().parents[3] / "configs" / "local.yaml"
APP, PREFIX = "smollm", "/smollm"


@pytest.fixture(scope="session")
def smollm(base_url):
    """The default model (``configs/local.yaml``'s engine and speculation sections) as app ``APP`` on
    the session's Serve, deployed once; yields (openai client, model name, its base URL); deleted at
    session end."""
    from workers.models.pull import pull_default

    pull_default()  # `rdserve model pull`: a no-op once cached
    cfg = load_config(LOCAL)
    deploy(cfg, name=APP, route_prefix=PREFIX)
    try:
        yield (OpenAI(base_url=f"{base_url}{PREFIX}/v1", api_key="unused", timeout=120, max_retries=0), cfg.model.name,
               f"{base_url}{PREFIX}/v1")
    finally:
        serve.delete(APP)
