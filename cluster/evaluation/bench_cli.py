"""``rdserve bench``: the load generator on its own, against any OpenAI-compatible endpoint."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from cluster.evaluation.loadgen import LoadSpec, RunResult, run_load
from cluster.evaluation.metrics import Slo
from cluster.evaluation.prompts import PromptFileError, load_prompts
from cluster.evaluation.target import served_model, tokenizer_counter

console = Console()
err_console = Console(stderr=True)


def parse_levels(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``. Raises typer.BadParameter on a non-positive or non-integer item."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise typer.BadParameter(f"levels must be integers >= 1, got {text!r}")
    return levels


def summary_table(title: str, rows: list[tuple[str, dict]]) -> Table:
    """One row per run: throughput, goodput and p50/p99 of TTFT, TPOT, ITL (ms)."""
    table = Table(title=title)
    for col in ("run", "ok/fail", "req/s", "out tok/s", "goodput", "TTFT p50/p99", "TPOT p50/p99",
                "ITL p50/p99", "tok/step"):
        table.add_column(col)

    def pair(d: dict) -> str:
        return "-" if d["p50"] is None else f"{d['p50']:.1f}/{d['p99']:.1f}"

    for label, s in rows:
        table.add_row(label, f"{s['completed']}/{s['failed']}", f"{s['request_throughput']:.2f}",
                      f"{s['output_throughput']:.1f}", "-" if s["goodput"] is None else f"{s['goodput']:.2f}",
                      pair(s["ttft_ms"]), pair(s["tpot_ms"]), pair(s["itl_ms"]),
                      "-" if s["tokens_per_step"] is None else f"{s['tokens_per_step']:.2f}")
    return table


def bench(
    url: str = typer.Option("http://127.0.0.1:8000", help="Base URL of the endpoint (without /v1)."),
    prompts: Path = typer.Option(..., help="JSONL prompts ('prompt' or 'messages', optional 'category')."),
    model: str | None = typer.Option(None, help="Model name; default: the first of GET /v1/models."),
    concurrency: str | None = typer.Option(None, help="Closed-loop client counts, e.g. 1,4,16 (default 1)."),
    rate: float | None = typer.Option(None, min=0.001, help="Open loop: Poisson arrivals, requests/s."),
    mode: str | None = typer.Option(None, help="rdserve.mode sent with each request: spec, plain or auto."),
    max_tokens: int = typer.Option(128, min=1, help="Completion tokens per request."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy."),
    max_requests: int = typer.Option(64, min=1, help="Requests per run at most."),
    duration_s: float = typer.Option(60.0, min=0.1, help="No new request after this many seconds."),
    grace_s: float = typer.Option(30.0, min=0.0, help="Then running requests get this long before cancel."),
    tokenizer: Path | None = typer.Option(None, help="Model directory whose tokenizer counts output tokens "
                                          "(default: the server's usage)."),
    slo_ttft_ms: float | None = typer.Option(None, help="Goodput SLO on TTFT (ms)."),
    slo_tpot_ms: float | None = typer.Option(None, help="Goodput SLO on TPOT (ms)."),
    slo_e2e_ms: float | None = typer.Option(None, help="Goodput SLO on end-to-end latency (ms)."),
    out: Path | None = typer.Option(None, help="Directory for bench.json (every figure, every request)."),
) -> None:
    """Load-test an OpenAI-compatible endpoint with streamed requests; print TTFT/TPOT/ITL/goodput."""
    if concurrency is not None and rate is not None:
        err_console.print("give at most one of --concurrency and --rate")
        raise typer.Exit(2)
    if mode not in (None, "spec", "plain", "auto"):
        err_console.print(f"--mode must be spec, plain or auto, got {mode!r}")
        raise typer.Exit(2)
    try:
        rows = load_prompts(prompts)
        model = model or served_model(url)
    except (PromptFileError, RuntimeError) as err:
        err_console.print(str(err), markup=False)
        raise typer.Exit(2) from None
    count = tokenizer_counter(tokenizer) if tokenizer else None
    common = dict(model=model, max_tokens=max_tokens, temperature=temperature, mode=mode,
                  max_requests=max_requests, duration_s=duration_s, grace_s=grace_s)
    specs = ([LoadSpec(concurrency=None, rate=rate, **common)] if rate is not None else
             [LoadSpec(concurrency=c, **common) for c in parse_levels(concurrency or "1")])
    slo = Slo(slo_ttft_ms, slo_tpot_ms, slo_e2e_ms) if (slo_ttft_ms or slo_tpot_ms or slo_e2e_ms) else None
    runs: list[RunResult] = [run_load(url, rows, spec, count) for spec in specs]
    console.print(summary_table(f"{url} ({model})", [(r.spec.label, r.summary(slo)) for r in runs]))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        payload = {"url": url, "runs": [r.as_dict(slo, with_records=True) for r in runs]}
        (out / "bench.json").write_text(json.dumps(payload, indent=1))
        console.print(f"wrote {out / 'bench.json'}")
