"""Shared fixtures: a tiny model + drafter, and ONE Ray Serve instance for the whole session.

Two applications are deployed on it, both serving the tiny model with the tiny drafter:
``/`` with ``spec_max_load`` 64 (auto requests speculate) and ``/auto0`` with ``spec_max_load`` 0
(auto requests decode plain).
"""

import logging
import socket
from pathlib import Path

import httpx
import pytest

from cluster.config import RdserveConfig, load_config

MODEL_NAME = "tiny-llama"  # tests/cluster/ingress/test_openai_api.py relies on these two values
MAX_SEQ_LEN = 256


@pytest.fixture(scope="session")
def tiny_config_path(tmp_path_factory) -> Path:
    """A YAML config beside a tiny model and drafter, referring to them by relative paths."""
    from tiny_model import make_tiny_drafter_dir, make_tiny_model_dir

    root = tmp_path_factory.mktemp("tiny")
    model_dir = make_tiny_model_dir(root / "model")
    make_tiny_drafter_dir(model_dir, root / "drafter")
    path = root / "tiny.yaml"
    path.write_text(
        f"model: {{name: {MODEL_NAME}, path: model}}\n"
        "drafter: {path: drafter}\n"
        f"engine: {{max_seq_len: {MAX_SEQ_LEN}, num_threads: 1}}\n"
        "speculation: {num_beams: 2, draft_len_per_beam: 3, spec_max_load: 64, default_mode: auto}\n"
    )
    return path


@pytest.fixture(scope="session")
def tiny_config(tiny_config_path) -> RdserveConfig:
    return load_config(tiny_config_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def base_url(tiny_config):
    """Start Ray + Serve once; yield the HTTP base URL of the main app."""
    import ray
    from ray import serve

    from cluster.deploy.app import deploy

    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, logging_level=logging.WARNING,
             _system_config={"metrics_report_interval_ms": 1000})  # metrics reach the agent within ~1 s
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        deploy(tiny_config)
        no_spec = tiny_config.model_copy(update={"speculation": tiny_config.speculation.model_copy(
            update={"spec_max_load": 0})})
        deploy(no_spec, name="auto0", route_prefix="/auto0")
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as client:
        yield client


# The default model, for the ingress tests that need a real model (tests/cluster/ingress/*default_model*).
LOCAL_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"
SMOLLM_APP, SMOLLM_PREFIX = "smollm", "/smollm"


@pytest.fixture(scope="module")
def smollm(base_url):
    """The default model (``configs/local.yaml``'s engine and speculation sections) as app ``SMOLLM_APP`` on
    the session's Serve; yields (openai client, model name, its base URL); deleted at the module's end,
    as every test app is: the session's Ray has too few CPUs to keep it beside the apps of later modules."""
    from openai import OpenAI
    from ray import serve

    from cluster.deploy.app import deploy
    from workers.models.pull import pull_default

    pull_default()  # `rdserve model pull`: a no-op once cached
    cfg = load_config(LOCAL_CONFIG)
    deploy(cfg, name=SMOLLM_APP, route_prefix=SMOLLM_PREFIX)
    try:
        yield (OpenAI(base_url=f"{base_url}{SMOLLM_PREFIX}/v1", api_key="unused", timeout=120, max_retries=0), cfg.model.name,
               f"{base_url}{SMOLLM_PREFIX}/v1")
    finally:
        serve.delete(SMOLLM_APP)
