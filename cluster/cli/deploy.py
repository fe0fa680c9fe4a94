"""``rdserve serve-config`` and ``rdserve k8s render``: the config as Ray's declarative Serve config and as
Kubernetes manifests (``cluster.deploy.serve_config``, ``cluster.deploy.k8s``)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from cluster.config import ConfigError, RdserveConfig, load_config

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"
k8s_app = typer.Typer(help="Kubernetes (KubeRay) manifests from an rdserve config.", no_args_is_help=True,
                      rich_markup_mode=None)
err_console = Console(stderr=True)


def _config(path: Path) -> RdserveConfig:
    try:
        return load_config(path)
    except ConfigError as err:
        err_console.print(f"[red]config error[/red]: {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _shown(path: Path) -> str:
    """``path`` relative to the project when inside it (stable headers in committed files)."""
    from cluster.deploy.app_args import PROJECT_ROOT

    path = path.resolve()
    return str(path.relative_to(PROJECT_ROOT)) if path.is_relative_to(PROJECT_ROOT) else str(path)


def serve_config_command(
    config: Path = typer.Option(DEFAULT_CONFIG, "--config", "-c", help="rdserve YAML config."),
    out: Path | None = typer.Option(None, "--out", help="Write to this file instead of standard output."),
) -> None:
    """Print the Ray Serve config that runs CONFIG (`serve deploy FILE`, KubeRay's serveConfigV2).

    One application, import_path cluster.deploy.app:app_builder, with the rdserve config inline in args (paths
    inside the project relative to its root) and every deployment's options as the code sets them.
    Start Ray with the environment listed in runtime_env.env_vars, as `rdserve up` does.
    """
    from cluster.deploy.serve_config import serve_config, to_yaml

    try:
        text = f"# Rendered by `rdserve serve-config --config {_shown(config)}`.\n" + \
            to_yaml(serve_config(_config(config)))
    except ConfigError as err:
        err_console.print(f"[red]config error[/red]: {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if out is None:
        print(text, end="")
    else:
        out.write_text(text)


@k8s_app.command("render")
def render(
    config: Path = typer.Option(..., "--config", "-c", help="rdserve YAML config (its kubernetes: section sizes "
                                "the pods)."),
    out: Path = typer.Option(..., "--out", help="Directory for namespace.yaml, rayservice.yaml, podmonitor.yaml."),
    image: str | None = typer.Option(None, "--image", help="Serving image (default: kubernetes.image)."),
    namespace: str | None = typer.Option(None, "--namespace", help="Namespace (default: kubernetes.namespace)."),
) -> None:
    """Render a KubeRay RayService (serveConfigV2 from `rdserve serve-config`, one worker group per
    engine pool), its OpenAI Service and a PodMonitor; `kubectl apply -f OUT` applies them (k8s/README.md)."""
    from cluster.deploy.k8s.render import manifests, write_manifests

    cfg = _config(config)
    from pydantic import ValidationError

    from cluster.config.kubernetes import KubernetesConfig

    try:  # the options obey the config's rules (a DNS-label namespace, a non-empty image)
        KubernetesConfig.model_validate({**cfg.kubernetes.model_dump(), "image": image or cfg.kubernetes.image,
                                         "namespace": namespace or cfg.kubernetes.namespace})
    except ValidationError as err:
        err_console.print(f"--{err.errors()[0]['loc'][0]}: {err.errors()[0]['msg']}", highlight=False)
        raise typer.Exit(2) from None
    try:
        objects = manifests(cfg, image, namespace)
    except ConfigError as err:
        err_console.print(f"[red]config error[/red]: {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    source = f"rdserve k8s render --config {_shown(config)}" + (f" --image {image}" if image else "") + \
        (f" --namespace {namespace}" if namespace else "")
    for path in write_manifests(objects, out, source):
        print(path)
