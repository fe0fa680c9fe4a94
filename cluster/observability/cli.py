"""``rdserve dashboards build|push`` and ``rdserve observability prometheus-config``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.console import Console

from cluster.config import ConfigError, load_config

dashboards_app = typer.Typer(help="The rdserve Grafana dashboard, built in code (grafana-foundation-sdk).",
                             no_args_is_help=True, rich_markup_mode=None)
observability_app = typer.Typer(help="Prometheus scrape config and alert rules for rdserve.", no_args_is_help=True,
                                rich_markup_mode=None)
console = Console()
err_console = Console(stderr=True)
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


@dashboards_app.command("build")
def build(out: Path = typer.Option(..., "--out", help="Directory to write rdserve.json into (created).")) -> None:
    """Write the dashboard's JSON (Grafana's dashboard model; import it in Grafana, or use `push`)."""
    from cluster.observability.dashboard import build_dashboard

    out.mkdir(parents=True, exist_ok=True)
    path = out / "rdserve.json"
    path.write_text(json.dumps(build_dashboard(), indent=2) + "\n")
    print(path)


@dashboards_app.command("push")
def push(
    grafana_url: str = typer.Option(..., "--grafana-url", help="Grafana base URL, e.g. http://grafana:3000."),
    token_env: str = typer.Option("GRAFANA_TOKEN", "--token-env", help="Environment variable holding a Grafana "
                                  "service account token (Editor role). Never passed as a flag, so it stays out "
                                  "of shell history and process lists."),
    folder: str = typer.Option("rdserve", "--folder", help="Folder title (uid 'rdserve'); created when missing."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the stored dashboard even if it changed in "
                                   "Grafana meanwhile (otherwise such a conflict is an error, 412)."),
) -> None:
    """Create or update the dashboard in Grafana through its HTTP API (grafana-client)."""
    from cluster.observability.dashboard import build_dashboard
    from cluster.observability.grafana import PushError, push_dashboard, shown_url

    token = os.environ.get(token_env)
    if not token:
        err_console.print(f"set the environment variable {token_env} to a Grafana service account token "
                          "(or name another variable with --token-env)")
        raise typer.Exit(2)
    try:
        answer = push_dashboard(grafana_url, token, build_dashboard(), folder_title=folder, overwrite=overwrite)
    except PushError as err:
        err_console.print(f"[red]push failed[/red]: {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    console.print(f"dashboard {answer.get('uid')} version {answer.get('version')} saved: "
                  f"{shown_url(grafana_url).rstrip('/')}{answer.get('url', '')}", highlight=False, soft_wrap=True)


@observability_app.command("prometheus-config")
def prometheus_config(
    out: Path = typer.Option(..., "--out", help="Directory for prometheus.yml and rdserve-alerts.yml (created)."),
    config: Path = typer.Option(DEFAULT_CONFIG, "--config", "-c", help="rdserve config: the metrics port "
                                "(observability.metrics_port) and TTFT SLO (serve.autoscaling.slo_ttft_ms)."),
    target: list[str] = typer.Option(None, "--target", help="HOST:PORT of a Ray metrics agent to scrape, once per "
                                     "node (default: 127.0.0.1 and the config's metrics port)."),
    scrape_interval_s: float = typer.Option(15.0, "--scrape-interval", min=0.1, help="Seconds between scrapes."),
    slo_ttft_ms: float = typer.Option(None, "--slo-ttft-ms", min=1, help="TTFT p90 SLO for the alert (default: "
                                      "serve.autoscaling.slo_ttft_ms, else 2000)."),
    alert_for_s: int = typer.Option(300, "--alert-for", min=0, help="Seconds a condition must hold to fire."),
) -> None:
    """Write a Prometheus scrape config for a local cluster and the rdserve alert rules.

    prometheus.yml scrapes Ray's metrics agent (rdserve's ray_rdserve_* and Ray Serve's ray_serve_*
    series) and loads rdserve-alerts.yml: TTFT p90 above the SLO, 5xx error rate, speculation
    acceptance collapse, replicas flapping, KV cache near full. Start Prometheus with the printed
    command, or copy the rules file into an existing Prometheus's rule_files. On a multi-node
    cluster pass --target once per node. Nothing is started or contacted.
    """
    from cluster.observability.alerts import AlertThresholds, write_prometheus_files

    try:
        cfg = load_config(config)
    except ConfigError as err:
        err_console.print(f"[red]config error[/red]: {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    scaling = cfg.serve.autoscaling
    slo_ms = slo_ttft_ms or (scaling.slo_ttft_ms if scaling and scaling.slo_ttft_ms else 2000.0)
    targets = target or [f"127.0.0.1:{cfg.observability.metrics_port}"]
    for t in targets:
        host, _, port = t.rpartition(":")
        if not host or "/" in t or " " in t or not port.isdigit() or not 0 < int(port) < 65536:
            raise typer.BadParameter(f"{t!r} is not HOST:PORT (e.g. 10.0.0.1:8080)", param_hint="--target")
    paths = write_prometheus_files(out, targets, AlertThresholds(ttft_p90_s=slo_ms / 1000, for_s=alert_for_s),
                                   scrape_interval_s)
    for path in paths:
        print(path)
    print(f"run: prometheus --config.file={paths[0]}")
