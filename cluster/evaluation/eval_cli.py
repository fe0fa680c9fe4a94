"""``rdserve eval``: the five evaluation steps against a running cluster, then the report.

Each step is also runnable alone (``--steps quality``); results accumulate in ``OUT/results.json``,
so steps run one at a time end in the same full report.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console

from cluster.config import ConfigError, RdserveConfig, load_config
from cluster.evaluation.acceptance import parse_shapes, sweep_shapes
from cluster.evaluation.baseline import run_baseline
from cluster.evaluation.bench_cli import parse_levels
from cluster.evaluation.compatibility import check_compatibility
from cluster.evaluation.metrics import Slo
from cluster.evaluation.prompts import PromptFileError, load_prompts
from cluster.evaluation.quality import engine_top2_gap, run_quality
from cluster.evaluation.report import write_report
from cluster.evaluation.staged_load import run_staged
from cluster.evaluation.target import Target, served_model

STEPS = ("baseline", "compatibility", "acceptance", "quality", "load")

console = Console()
err_console = Console(stderr=True)


def parse_steps(text: str) -> list[str]:
    """``"all"`` or a comma-separated subset of ``STEPS``. Raises typer.BadParameter on unknown names."""
    steps = list(STEPS) if text == "all" else [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        raise typer.BadParameter(f"unknown step(s) {unknown}; choose from {', '.join(STEPS)} or 'all'")
    return steps


def default_shapes(cfg: RdserveConfig) -> list[tuple[int, int]]:
    """The configured shape, one beam of the same length, and half the draft length."""
    b, d = cfg.speculation.num_beams, cfg.speculation.draft_len_per_beam
    return list(dict.fromkeys([(1, d), (b, max(1, d // 2)), (b, d)]))


def _fail(message: str) -> typer.Exit:
    err_console.print(f"[red]eval[/red]: {message}", highlight=False, soft_wrap=True)
    return typer.Exit(2)


def evaluate(
    config: Path = typer.Option(..., "--config", "-c", help="The cluster's YAML config."),
    prompts: Path = typer.Option(..., help="JSONL prompts with 'category' (optional 'reference', 'stop')."),
    out: Path = typer.Option(Path("eval-report"), help="Directory for report.md, results.json, PNGs."),
    url: str | None = typer.Option(None, help="Cluster base URL; default: serve.host/port of the config."),
    steps: str = typer.Option("all", help=f"'all' or a comma-separated subset of {', '.join(STEPS)}."),
    max_tokens: int = typer.Option(64, min=1, help="Output length (completion tokens) per request."),
    baseline_concurrency: int = typer.Option(1, min=1, help="Closed-loop concurrency of the baseline."),
    levels: str = typer.Option("1,2,4,8", help="Staged load: closed-loop concurrency levels."),
    rate: float | None = typer.Option(None, min=0.001, help="Staged load: also an open-loop Poisson rate (req/s)."),
    requests_per_level: int = typer.Option(16, min=1, help="Staged load: requests per run (>= 2 x level)."),
    duration_s: float = typer.Option(120.0, min=1.0, help="Per run: no new request after this many seconds."),
    shapes: str | None = typer.Option(None, help="Acceptance sweep, e.g. 1x4,2x4,4x4 (num_beams x draft_len)."),
    tolerance: float = typer.Option(0.1, min=0.0, help="Quality: top-2 log-prob gap (nats) below which a "
                                    "bf16/fp16 greedy mismatch is tolerated."),
    samples: int = typer.Option(4, min=0, help="Quality: sampled completions per prompt and mode (0 = skip)."),
    slo_ttft_ms: float | None = typer.Option(None, help="Goodput SLO on TTFT (ms)."),
    slo_tpot_ms: float | None = typer.Option(None, help="Goodput SLO on TPOT (ms)."),
    slo_e2e_ms: float | None = typer.Option(None, help="Goodput SLO on end-to-end latency (ms)."),
    progress: bool = typer.Option(True, help="Progress bars."),
) -> None:
    """Measure speculative decoding end to end on your model and prompts; write a readable report."""
    selected = parse_steps(steps)
    try:
        cfg = load_config(config)
        rows = load_prompts(prompts)
        compat = check_compatibility(cfg, None)
        shape_list = parse_shapes(shapes) if shapes else default_shapes(cfg)
    except (ConfigError, PromptFileError, ValueError) as err:
        raise _fail(str(err)) from None
    if cfg.model.path is None:
        from workers.models.pull import pull_default

        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": pull_default()})})
    host = "127.0.0.1" if cfg.serve.host in ("0.0.0.0", "::") else cfg.serve.host
    base_url = (url or f"http://{host}:{cfg.serve.port}").rstrip("/")
    needs_server = set(selected) - {"compatibility", "acceptance"}
    try:
        model = served_model(base_url) if needs_server else cfg.model.name
    except RuntimeError as err:
        raise _fail(f"{err}; start the cluster with `rdserve up --config {config}` or pass --url") from None

    from workers.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model.path)
    encode = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    target = Target(base_url, model, lambda text: len(encode(text)))
    slo = Slo(slo_ttft_ms, slo_tpot_ms, slo_e2e_ms) if (slo_ttft_ms or slo_tpot_ms or slo_e2e_ms) else None

    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    results["meta"] = {"url": base_url, "model": model, "config": str(config), "prompts": str(prompts),
                       "created": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": selected}
    for step in selected:
        console.rule(f"[bold]{step}")
        if step == "compatibility":
            results[step] = {**compat, "server": check_compatibility(cfg, base_url)["server"]}
        elif step == "baseline":
            results[step] = run_baseline(target, cfg, rows, max_tokens=max_tokens, concurrency=baseline_concurrency,
                                         duration_s=duration_s, slo=slo, progress=progress)
        elif step == "acceptance":
            results[step] = sweep_shapes(cfg, rows, shape_list, max_tokens, progress)
        elif step == "quality":
            try:
                results[step] = run_quality(target, rows, encode, dtype=cfg.engine.dtype, max_tokens=max_tokens,
                                            tolerance=tolerance, samples=samples,
                                            gap_fn=lambda: engine_top2_gap(cfg), progress=progress)
            except RuntimeError as err:
                raise _fail(str(err)) from None
        elif step == "load":
            results["staged_load"] = run_staged(
                target, rows, levels=parse_levels(levels), max_tokens=max_tokens,
                requests_per_level=requests_per_level, duration_s=duration_s, rate=rate, slo=slo,
                replicas=cfg.serve.replicas, progress=progress)
        write_report(results, out)
    paths = write_report(results, out)
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))
    decision = results.get("staged_load", {}).get("decision")
    if decision:
        console.print(f"speculation.spec_max_load = {decision['spec_max_load']} (see {out / 'speculation.yaml'})")
