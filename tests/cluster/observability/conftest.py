"""One extra application on the session's Ray Serve instance for the metrics tests: a tiny model with
a drafter self-distilled on it (so drafts are often accepted), served as ``tiny-obs`` at ``/obs``; its
``model_name`` label isolates its series from every other test's traffic. A small KV cache (24 blocks
of 16 tokens) makes concurrent long requests preempt."""

import pytest
from ray import serve

from cluster.deploy.app import deploy

OBS_MODEL = "tiny-obs"


@pytest.fixture(scope="session")
def obs_url(base_url, tiny_config, tiny_model_dirs, trained_drafter_dirs):
    engine = tiny_config.engine.model_copy(update={"num_kv_blocks": 24, "tokens_per_block": 16,
                                                   "max_batch_size": 8})
    cfg = tiny_config.model_copy(update={
        "model": tiny_config.model.model_copy(update={"name": OBS_MODEL, "path": tiny_model_dirs["untied_mqa"]}),
        "drafter": tiny_config.drafter.model_copy(update={"path": trained_drafter_dirs["untied_mqa"]}),
        "engine": engine})
    deploy(cfg, name="obs", route_prefix="/obs")
    yield f"{base_url}/obs"
    serve.delete("obs")
