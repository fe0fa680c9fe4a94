"""The Serve config of an rdserve config: what ``serve deploy`` and KubeRay's ``serveConfigV2`` read.

One application, ``import_path: cluster.deploy.app:app_builder``, carrying the rdserve config inline in
``args``: Ray imports the builder on the cluster and gets the same application ``rdserve up`` deploys.
Its ``deployments`` section is written from that application itself (the options the code binds:
replicas or autoscaling, ``max_ongoing_requests``, resources, placement, request router), converted
the way Ray's own ``serve build`` does, so the YAML an operator reads cannot drift from the code;
Serve applies them over the code's options, which are the same.

Paths: inside the config, a path within the project (e.g. the committed drafter) is written relative to
the project root and resolved by :func:`cluster.deploy.app_args.config_from_args` against the project
root where the builder runs (this checkout, or the image's copy); other paths stay absolute.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from cluster.deploy.app_args import PROJECT_ROOT
from cluster.config.keys import ApiKeySource
from cluster.config import ConfigError, RdserveConfig

IMPORT_PATH = "cluster.deploy.app:app_builder"


def _portable(value, plain):
    """``plain`` (the JSON dump) with every ``Path`` of ``value`` (the python dump) in project-relative form."""
    if isinstance(value, Path):
        return str(value.relative_to(PROJECT_ROOT)) if value.is_relative_to(PROJECT_ROOT) else str(value)
    if isinstance(value, dict):
        return {k: _portable(value[k], plain[k]) for k in plain}
    if isinstance(value, (list, tuple)):
        return [_portable(v, p) for v, p in zip(value, plain)]
    return plain


def portable_config(cfg: RdserveConfig) -> dict:
    """``cfg`` as JSON-ready data: the fields the YAML (or code) set, the others left to their defaults,
    paths within the project relative to its root. ``parse_config(portable_config(cfg), PROJECT_ROOT)``
    gives ``cfg`` back.

    Raises:
        ConfigError: ``serve.api_keys`` lists keys: dumped, each would be its masked form, not the key
            (as ``rdserve k8s render``, keys must come from ``{env: VAR}`` or ``{file: PATH}``).
    """
    keys = cfg.serve.api_keys
    if keys is not None and not isinstance(keys, ApiKeySource):
        raise ConfigError("serve.api_keys: keys written in the config cannot go into a Serve config (it would "
                          "carry them masked, not the keys); use {env: RDSERVE_API_KEYS} or {file: PATH}, read "
                          "where the ingress runs")
    return _portable(cfg.model_dump(mode="python", exclude_unset=True), cfg.model_dump(mode="json", exclude_unset=True))


def deployment_options(cfg: RdserveConfig) -> list[dict]:
    """The options of every deployment of ``build_app(cfg)`` as Serve config entries (name first),
    from the bound application, converted as ``serve build`` converts them."""
    from ray.serve._private.build_app import build_app as build_deployments
    from ray.serve.deployment import deployment_to_schema

    from cluster.deploy.app import APP_NAME, build_app

    built = build_deployments(build_app(cfg), name=APP_NAME)
    return [deployment_to_schema(d).model_dump(mode="json", exclude_unset=True) for d in built.deployments]


def serve_config(cfg: RdserveConfig, host: str | None = None, port: int | None = None) -> dict:
    """The Serve config (``ray.serve.schema.ServeDeploySchema`` form) that runs ``cfg``.

    ``host``/``port``: Serve's HTTP address (default ``serve.host``/``serve.port``; in a pod
    ``0.0.0.0``). ``runtime_env.env_vars`` is ``cluster.deploy.app.SERVE_ENV``, which the Ray processes
    themselves should also have (``rdserve up`` and the Kubernetes manifests set it for them).

    Raises:
        ConfigError: keys written in the config (see :func:`portable_config`).
    """
    from cluster.deploy.app import APP_NAME, SERVE_ENV

    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": host or cfg.serve.host, "port": port or cfg.serve.port},
        "applications": [{
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": IMPORT_PATH,
            "runtime_env": {"env_vars": dict(SERVE_ENV)},
            "args": {"config": portable_config(cfg)},
            "deployments": deployment_options(cfg),
        }],
    }


def to_yaml(data: dict) -> str:
    """Block-style YAML, keys in the order given."""
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)
