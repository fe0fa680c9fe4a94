"""``rdserve``: start the serving cluster, generate offline, pull the default model, train drafters."""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Literal

import httpx
from jinja2.exceptions import TemplateError
import typer

from cluster.cli.calibrate import calibrate
from cluster.cli.common import console, err_console, exit_config_error, startable_config, with_model_dir
from cluster.config import ConfigError, RdserveConfig
from cluster.cli.deploy import k8s_app, serve_config_command
from cluster.evaluation.bench_cli import bench
from cluster.evaluation.eval_cli import evaluate
from cluster.observability.cli import dashboards_app, observability_app
from workers.training.cli import drafter_app

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"
READY_TIMEOUT_S = 300.0

app = typer.Typer(help="LLM serving with ReDrafter speculative decoding (Ray Serve, OpenAI API).",
                  no_args_is_help=True, rich_markup_mode=None)  # plain help: rich truncates long option names
model_app = typer.Typer(help="Manage the default model (SmolLM2-135M-Instruct).", no_args_is_help=True, rich_markup_mode=None)
app.add_typer(model_app, name="model")
app.add_typer(drafter_app, name="drafter")
app.command("bench")(bench)
app.command("eval")(evaluate)
app.command("calibrate")(calibrate)
app.add_typer(dashboards_app, name="dashboards")
app.add_typer(observability_app, name="observability")
app.command("serve-config")(serve_config_command)
app.add_typer(k8s_app, name="k8s")

ConfigOption = typer.Option(DEFAULT_CONFIG, "--config", "-c", help="YAML config (relative paths inside it "
                            "resolve against its own directory).")


@app.command()
def up(config: Path = ConfigOption) -> None:
    """Start Ray and Serve locally, deploy the OpenAI-compatible API and serve in the foreground.

    Ctrl-C or SIGTERM drains (new requests get 503 + Retry-After; those in flight have
    serve.drain_timeout_s to finish, the rest end with an error), then shuts Serve and Ray down (exit 0).
    A second signal stops at once.
    """
    cfg = with_model_dir(startable_config(config))
    from cluster.deploy.app import SERVE_ENV, deploy, local_serve_env
    from cluster.deploy.local_ray import keep_ray_on_loopback, loopback_only, ray_init_options

    local_env = local_serve_env(cfg.serve.port)
    direct_ingress = os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS",  # else Serve's proxy serves the port
                                    local_env["RAY_SERVE_ENABLE_DIRECT_INGRESS"]) == "1"
    _check_ports(cfg, direct_ingress)
    # Before ray.init (Ray's processes inherit the driver's environment). An operator's own values of
    # SERVE_ENV and of RAY_SERVE_ENABLE_DIRECT_INGRESS win; the direct-ingress port is this run's serve.port.
    operator_may_set = {**SERVE_ENV, "RAY_SERVE_ENABLE_DIRECT_INGRESS": local_env.pop("RAY_SERVE_ENABLE_DIRECT_INGRESS")}
    for key, value in operator_may_set.items():
        os.environ.setdefault(key, value)
    os.environ.update(local_env)
    if loopback_only(cfg):  # every Ray listener on loopback (cluster.deploy.local_ray)
        keep_ray_on_loopback()
    import ray
    from ray import serve

    ray.init(logging_level=logging.WARNING, **ray_init_options(cfg))
    stop = threading.Event()

    def request_stop(*_) -> None:  # the first signal shuts down cleanly; a second one is not caught
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, request_stop)
    try:
        with console.status("starting Ray Serve and loading the engine replicas"):
            proxy_port = _free_port(cfg.serve.host) if direct_ingress else cfg.serve.port
            serve.start(http_options={"host": cfg.serve.host, "port": proxy_port})
            deploy(cfg)
            base_url = _wait_until_healthy(cfg)
        _print_ready(cfg, base_url)
        while not stop.wait(1.0):
            pass
        _drain(cfg)
    finally:
        serve.shutdown()
        ray.shutdown()


def _check_ports(cfg: RdserveConfig, direct_ingress: bool) -> None:
    """Exit with code 2 naming the field when something listens on ``serve.port`` or
    ``observability.metrics_port``; wait (at most ``PORT_LINGER_S``) while only a stopped server's closed
    connections hold one its new server cannot bind over (``serve.port`` under Serve's direct ingress,
    which binds without ``SO_REUSEADDR``; see :mod:`cluster.deploy.local_ray`)."""
    from cluster.deploy.local_ray import PORT_LINGER_S, port_state, wait_while_closing

    for field, port, reuse in (("serve.port", cfg.serve.port, not direct_ingress),
                               ("observability.metrics_port", cfg.observability.metrics_port, True)):
        state = port_state(port, reuse)
        if state == "closing":
            console.print(f"{field}: port {port} is held by closed connections of a stopped server (TIME-WAIT); "
                          f"waiting until it is released (at most {PORT_LINGER_S:.0f} s)", highlight=False)
            state = wait_while_closing(port, reuse)
        if state != "free":
            why = "is in use (another Ray or rdserve?)" if state == "listening" else \
                f"was not released within {PORT_LINGER_S:.0f} s"
            err_console.print(f"[red]config error[/red]: {field}: port {port} {why}; choose a free port",
                              highlight=False)
            raise typer.Exit(2)


def _free_port(host: str) -> int:
    """A free TCP port on ``host``: with direct ingress, Serve's own proxy (which Serve always starts)
    listens there, and ``serve.port`` belongs to the ingress replica."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _drain(cfg: RdserveConfig) -> None:
    """Graceful drain before shutdown (``cluster.ingress.drain``): new requests get 503, those in flight have
    ``serve.drain_timeout_s`` to finish, the rest end with an error."""
    from cluster.deploy.app import APP_NAME
    from cluster.ingress.drain import drain_app

    console.print(f"draining: finishing the requests in flight (up to {cfg.serve.drain_timeout_s:g} s)")
    try:
        report = drain_app(APP_NAME, cfg.serve.drain_timeout_s)
        console.print(f"drained: {report['finished']} finished, {report['aborted']} aborted; shutting down")
    except Exception as err:  # shut down anyway
        err_console.print(f"drain failed ({type(err).__name__}: {err}); shutting down")


def _wait_until_healthy(cfg: RdserveConfig) -> str:
    """Poll ``GET /health`` until 200; return the base URL. Raises TimeoutError after READY_TIMEOUT_S."""
    host = "127.0.0.1" if cfg.serve.host in ("0.0.0.0", "::") else cfg.serve.host
    base_url = f"http://{host}:{cfg.serve.port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=5.0).status_code == 200:
                return base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url}/health did not become ready within {READY_TIMEOUT_S:.0f} s")


def _print_ready(cfg: RdserveConfig, base_url: str) -> None:
    body = json.dumps({"model": cfg.model.name, "messages": [{"role": "user", "content": "Hello!"}],
                       "max_tokens": 64})
    def count(replicas: int, scaling) -> str:
        return f"{scaling.min_replicas}..{scaling.max_replicas} replicas (autoscaling)" if scaling \
            else f"{replicas} replica(s)"

    pools = cfg.serve.pools
    replicas = (f"spec pool {count(pools.spec.replicas, pools.spec.autoscaling)}, plain pool "
                f"{count(pools.plain.replicas, pools.plain.autoscaling)}" if pools
                else count(cfg.serve.replicas, cfg.serve.autoscaling))
    if cfg.serve.colocated(cfg.engine.tp_size):
        replicas += " in the ingress's process (serve.colocate)"
    console.print(f"[green]rdserve is up[/green]: {base_url}/v1  (model {cfg.model.name}, "
                  f"{replicas}, drafter {cfg.drafter.path or 'none'})")
    try:
        kv = httpx.get(f"{base_url}/health", timeout=5.0).json()["kv_cache"]
        console.print(f"paged KV cache per replica: {kv['blocks']} blocks x {kv['tokens_per_block']} tokens = "
                      f"{kv['tokens']} tokens, {kv['mib']} MiB, {kv.get('dtype', '?')}")
    except (httpx.HTTPError, KeyError, ValueError):
        pass
    if cfg.observability.enabled:
        host = base_url.rsplit(":", 1)[0]
        console.print(f"metrics (Prometheus): {host}:{cfg.observability.metrics_port}/metrics (Ray's metrics agent; "
                      f"also proxied at {base_url}/metrics)", highlight=False, soft_wrap=True)
    auth = ""
    if cfg.serve.api_keys is not None:  # never print a key: the user substitutes one of theirs
        auth = " -H 'Authorization: Bearer YOUR_KEY'"
        print("API keys are on (serve.api_keys): /v1/* needs 'Authorization: Bearer KEY' with one of them")
    print(f"try:\n  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
    print("Ctrl-C to stop.", flush=True)


@app.command()
def generate(
    config: Path = ConfigOption,
    prompt: str | None = typer.Option(None, help="One prompt (raw text, or a user message with --chat)."),
    prompts: Path | None = typer.Option(None, exists=True, dir_okay=False, readable=True,
                                        help="JSONL file: each line has 'prompt' (raw text) or "
                                        "'messages' (chat), optionally 'category'."),
    chat: bool = typer.Option(False, "--chat", help="Apply the chat template to --prompt."),
    max_tokens: int = typer.Option(128, min=1, help="Completion tokens per prompt."),
    mode: str = typer.Option("spec", help="spec: ReDrafter, drafting the config's num_beams x draft_len_per_beam "
                             "every step whatever speculation.policy says (the served 'auto' mode, which leaves "
                             "each step to the policy, needs `rdserve up`); or plain decoding."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy."),
    seed: int | None = typer.Option(None, help="Sampling seed."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per prompt instead of text."),
) -> None:
    """Generate with an Engine in this process (no Ray, no HTTP): for checks and benchmarks."""
    if (prompt is None) == (prompts is None):
        err_console.print("give exactly one of --prompt and --prompts")
        raise typer.Exit(2)
    if prompt == "":
        err_console.print("--prompt: the prompt is empty")
        raise typer.Exit(2)
    if mode not in ("spec", "plain"):
        err_console.print(f"--mode must be 'spec' or 'plain', got '{mode}'")
        raise typer.Exit(2)
    cfg = startable_config(config)
    if mode == "spec" and cfg.drafter.path is None:
        err_console.print("--mode spec needs drafter.path in the config")
        raise typer.Exit(2)
    if prompts is not None:
        items = _read_prompts(prompts)
    else:
        items = [("--prompt", {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})]
    from cluster.replica.build import build_engine
    from workers.sampling_params import SamplingParams

    try:
        engine = build_engine(with_model_dir(cfg))
    except ConfigError as err:  # what the model allows (a pulled default model is read only here)
        exit_config_error(err)
    err_console.print(f"[dim]{speculation_line(engine.spec_selection, engine.compute_path)}[/dim]", highlight=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    try:
        for where, item in items:
            try:
                result = _generate_one(engine, item, params, mode)
            except _Unservable as err:
                err_console.print(f"{where}: {err}", markup=False, highlight=False)
                raise typer.Exit(2) from None
            if as_json:
                print(json.dumps(result), flush=True)
            else:
                print(result["text"], flush=True)  # as generated: no wrapping, no rich markup or emoji codes
                console.print(f"[dim]{result['completion_tokens']} tokens in {result['num_steps']} steps "
                              f"({result['tokens_per_step']:.2f} tokens/step, {result['latency_s']:.2f} s, "
                              f"{result['mode']}, finish {result['finish_reason']})[/dim]")
    finally:
        engine.close()  # a tensor-parallel engine shuts its MPI ranks down


def speculation_line(selected, compute_path: str) -> str:
    """One line for the start of ``rdserve generate``: the speculation settings in effect and, for a
    calibration, whether its step times are trusted here (a file of another compute path or code
    version is only a seed: the engine measures its own at start, and a warning says why)."""
    line = f"speculation policy: {selected.source} (compute path {compute_path})"
    if selected.measure_at_start:
        return line + "; step times measured at start (the calibration is not of this engine)"
    if selected.source.endswith(".calibration"):
        return line + "; the calibration's step times are trusted (same compute path and code version)"
    return line


def _read_prompts(path: Path) -> list[tuple[str, dict]]:
    """The prompts of a JSONL file, each with its ``path:line`` for error messages."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        err_console.print(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})")
        raise typer.Exit(2) from None
    items = []
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            err_console.print(f"{path}:{n}: not valid JSON ({err.msg})")
            raise typer.Exit(2) from None
        if not isinstance(item, dict) or ("prompt" in item) == ("messages" in item):
            err_console.print(f"{path}:{n}: each line needs exactly one of 'prompt' and 'messages'")
            raise typer.Exit(2)
        if not item.get("prompt", True) or not item.get("messages", True):
            err_console.print(f"{path}:{n}: the prompt is empty")
            raise typer.Exit(2)
        if not isinstance(item.get("prompt", ""), str):
            err_console.print(f"{path}:{n}: 'prompt' must be a string")
            raise typer.Exit(2)
        messages = item.get("messages", [])
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            err_console.print(f"{path}:{n}: 'messages' must be a list of {{role, content}} strings", markup=False)
            raise typer.Exit(2)
        items.append((f"{path}:{n}", item))
    return items


class _Unservable(ValueError):
    """A prompt the engine refuses before decoding: it has no chat template, or the prompt (plus
    ``max_tokens``) does not fit the context or the KV cache."""


def _generate_one(engine, item: dict, params, mode: Literal["spec", "plain"]) -> dict:
    """Run one prompt to completion; counters come from the final delta.

    Raises:
        _Unservable: the engine refuses the prompt (see the class).
    """
    start = time.perf_counter()
    try:
        ids = engine.encode_chat(item["messages"]) if "messages" in item else engine.encode_prompt(item["prompt"])
    except (ValueError, TemplateError) as err:  # no chat template, or its raise_exception ("roles must alternate")
        raise _Unservable(str(err)) from None
    deltas = engine.generate(ids, params, mode, force_draft=mode == "spec")
    try:
        first = next(deltas)  # the request is queued here: add_request refuses what cannot fit
    except ValueError as err:
        raise _Unservable(f"{err}; shorten the prompt or lower --max-tokens, or raise engine.max_seq_len or the "
                          "KV cache (engine.num_kv_blocks, engine.kv_cache_fraction)") from None
    text, token_ids, last = [], [], None
    for last in itertools.chain([first], deltas):
        text.append(last.text)
        token_ids.extend(last.token_ids)
    latency_s = time.perf_counter() - start
    result = {
        "text": "".join(text), "token_ids": token_ids, "mode": mode,
        "prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
        "num_steps": last.num_steps, "accepted_draft_tokens": last.accepted_draft_tokens,
        "tokens_per_step": round(last.tokens_per_step, 4),
        "finish_reason": last.finish_reason, "latency_s": round(latency_s, 4),
    }
    if "category" in item:
        result["category"] = item["category"]
    return result


@model_app.command("pull")
def model_pull(force: bool = typer.Option(False, "--force", help="Convert again even if cached.")) -> None:
    """Convert the default GGUF checkpoint into a Hugging Face directory in the cache; print its path."""
    from workers.models.pull import pull_default

    with console.status("pulling SmolLM2-135M-Instruct"):
        model_dir = pull_default(force)
    print(model_dir)
