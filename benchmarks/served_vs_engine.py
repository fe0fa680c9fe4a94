r"""Served over HTTP vs the same engine in process: output tokens/s and time to first token.

Side by side in one run, same config, same prompts, greedy:
- **engine**: an ``Engine`` built and stepped on this process's main thread (what ``rdserve
  generate`` does), fed closed loop: ``c`` requests in flight, the next one added when one ends;
- **served**: ``rdserve up --config CONFIG`` started as a subprocess, driven over HTTP by the
  streaming load generator (``cluster.evaluation.loadgen``), closed loop with ``c`` clients.

For each mode (``rdserve.mode`` plain / spec / auto, or ``default``: none sent, the config's
``speculation.default_mode``) and concurrency ``c``: the in-process engine gives each request the mode
the serving replica would (a ``spec`` request drafts every step, an ``auto`` one leaves each iteration
to the speculation policy; ``serve.pools`` routing is not modelled); output tokens/s over the run
(completion tokens / wall time) and TTFT p50; engine and served runs alternate for ``--rounds``
rounds (both live in memory at once, one idles while the other runs), so machine drift hits both. Then TTFT at low load: a short chat prompt with
``max_tokens`` 1, sent ``--ttft-runs`` times one after another (engine: from ``add_request`` to the
first delta; served: from sending the HTTP request to the first streamed content chunk, with the
load generator's asyncio client and with a plain synchronous httpx client, whose own cost is smaller;
``--ttft-only`` measures just this). Prints a Markdown table and writes JSON.

Usage:
    python benchmarks/served_vs_engine.py --config configs/local.yaml \
        --prompts ../shared/datasets/broad/dev.jsonl --num-prompts 9 --max-tokens 128 \
        --concurrency 1,16 --out benchmarks/results/served_vs_engine
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_loop import closed_loop
from bench_prompts import DATASETS, add_load_options, chat_prompts
from bench_report import write_report

from cluster.config import SpeculationConfig, load_config
from cluster.replica.spec_mode import choose_mode
from cluster.evaluation.loadgen import LoadSpec, run_load
from cluster.evaluation.prompts import PromptFileError, PromptRow
from cluster.replica.build import build_engine
from workers.engine import Engine
from workers.sampling_params import SamplingParams

TTFT_PROMPT = [{"role": "user", "content": "Hi! What is your name?"}]


def replica_mode(engine: Engine, spec_cfg: SpeculationConfig, requested: str | None, load: int) -> tuple[str, bool]:
    """The engine ``(mode, force_draft)`` the serving replica gives a request whose ``rdserve.mode`` is
    ``requested`` (None: the config's ``default_mode``) at ``load`` requests held, as
    :meth:`cluster.replica.replica.EngineReplica._generate` decides it: a ``spec`` request drafts every
    step; an ``auto`` one leaves each iteration to the speculation policy."""
    selected = engine.spec_selection
    if selected.spec_max_load is not None:
        spec_cfg = spec_cfg.model_copy(update={"spec_max_load": selected.spec_max_load})
    can_draft = engine.speculative_available and engine.forced_shape is not None
    mode, _ = choose_mode(load, requested, spec_cfg, can_draft, selected.policy.live)
    return mode, (requested or spec_cfg.default_mode) == "spec"


def engine_closed_loop(engine: Engine, prompts: list[list[int]], num_requests: int, concurrency: int,
                       mode: str, max_tokens: int, spec_cfg: SpeculationConfig) -> dict:
    """Closed loop on the engine itself (:func:`bench_loop.closed_loop`): ``concurrency`` requests in
    flight, each given the engine mode the serving replica would give a request with ``rdserve.mode``
    ``mode`` (:func:`replica_mode`; ``"default"``: none sent); returns tokens/s and TTFTs."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    requested = None if mode == "default" else mode

    def add(rid: str, i: int, in_flight: int) -> None:
        engine_mode, force_draft = replica_mode(engine, spec_cfg, requested, in_flight)
        engine.add_request(rid, prompts[i % len(prompts)], params, engine_mode, force_draft)

    run = closed_loop(engine, num_requests, concurrency, add)
    return {"output_tokens": run.completion_tokens, "duration_s": run.wall_s, "output_throughput": run.tokens_per_s,
            "ttft_p50_ms": 1e3 * statistics.median(run.ttft_s.values())}


def engine_ttft(engine: Engine, runs: int) -> list[float]:
    """Seconds from ``add_request`` to the first delta, short chat prompt, max_tokens 1, one at a time."""
    out = []
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for _ in range(runs):
        t0 = time.perf_counter()
        ids = engine.encode_chat(TTFT_PROMPT)  # the server tokenizes too
        next(iter(engine.generate(ids, params, "plain")))
        out.append(time.perf_counter() - t0)
    return out


def start_server(config: str, base_url: str, timeout_s: float = 300.0) -> subprocess.Popen:
    """``rdserve up`` in a new session (so its whole process group can be stopped); waits for /health.
    While a port is still held by the Ray processes of a server just stopped (they can linger a few
    seconds), it retries for up to a minute.

    Raises:
        RuntimeError: ``rdserve up`` exited (the end of its output is in the message).
        TimeoutError: not healthy within ``timeout_s``.
    """
    rdserve = Path(sys.executable).with_name("rdserve")
    deadline = time.monotonic() + timeout_s
    ports_deadline = time.monotonic() + 60.0
    while True:
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen([str(rdserve), "up", "--config", config], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        else:
            stop_server(proc)
            raise TimeoutError(f"{base_url}/health not ready after {timeout_s:.0f} s")
        log.seek(0)
        tail = log.read().decode(errors="replace")[-2000:]
        if proc.returncode == 2 and "in use" in tail and time.monotonic() < ports_deadline:
            time.sleep(2.0)
            continue
        raise RuntimeError(f"rdserve up exited with {proc.returncode}:\n{tail}")


def stop_server(proc: subprocess.Popen, linger_s: float = 30.0) -> None:
    """SIGINT to ``rdserve up``'s process group, then wait until every process of the group is gone
    (Ray's raylet, GCS and workers can outlive ``rdserve up`` by seconds, and a next ``rdserve up``
    would meet them); SIGKILL what is left after ``linger_s``."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + linger_s
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def served_run(base_url: str, model: str, rows: list[PromptRow], num_requests: int, concurrency: int,
               mode: str | None, max_tokens: int) -> dict:
    spec = LoadSpec(model=model, max_tokens=max_tokens, mode=mode, concurrency=concurrency,
                    max_requests=num_requests, duration_s=3600.0, grace_s=60.0)
    summary = run_load(base_url, rows, spec, progress=False).summary()
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed at {mode} c={concurrency}")
    return {"output_tokens": summary["output_tokens"], "duration_s": summary["duration_s"],
            "output_throughput": summary["output_throughput"], "ttft_p50_ms": summary["ttft_ms"]["p50"]}


def served_ttft_sync(base_url: str, model: str, runs: int) -> list[float]:
    """Seconds to the first content chunk with a plain synchronous httpx client (one connection, kept
    alive): the server's share without the load generator's asyncio client around it."""
    body = {"model": model, "messages": TTFT_PROMPT, "max_tokens": 1, "temperature": 0.0, "stream": True,
            "rdserve": {"mode": "plain"}}
    out = []
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for _ in range(runs):
            t0, first = time.perf_counter(), None
            with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if first is None and line.startswith("data: {"):
                        choices = json.loads(line[6:])["choices"]
                        if choices and choices[0]["delta"].get("content"):
                            first = time.perf_counter()
            if first is None:
                raise RuntimeError("a TTFT request streamed no content")
            out.append(first - t0)
    return out


def served_ttft(base_url: str, model: str, runs: int) -> list[float]:
    row = PromptRow(category="ttft", messages=TTFT_PROMPT)
    spec = LoadSpec(model=model, max_tokens=1, mode="plain", concurrency=1, max_requests=runs,
                    duration_s=3600.0, grace_s=60.0)
    return [r.ttft_s for r in run_load(base_url, [row], spec, progress=False).records if r.ok]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml", help="rdserve config served and run in process")
    ap.add_argument("--prompts", default=str(DATASETS / "broad/dev.jsonl"), help="prompt JSONL (chat rows)")
    add_load_options(ap)
    ap.add_argument("--ttft-runs", type=int, default=20, help="sequential max_tokens=1 requests for TTFT, per round")
    ap.add_argument("--rounds", type=int, default=2, help="engine and served runs alternate this many times; "
                    "means are reported")
    ap.add_argument("--ttft-only", action="store_true", help="measure only the low-load TTFT (no throughput runs)")
    ap.add_argument("--out", default="benchmarks/results/served_vs_engine", help="output path without suffix")
    args = ap.parse_args()
    for name in ("num_prompts", "max_tokens", "ttft_runs", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency: comma-separated integers expected, got {args.concurrency!r}")
    if any(c < 1 for c in levels):
        ap.error(f"--concurrency levels must be >= 1, got {args.concurrency!r}")
    modes = [] if args.ttft_only else [m.strip() for m in args.modes.split(",")]
    if bad := [m for m in modes if m not in ("plain", "spec", "auto", "default")]:
        ap.error(f"--modes: {bad} not among plain, spec, auto, default (none sent)")

    try:  # the prompts first: a bad file fails before the server starts
        rows = chat_prompts(args.prompts, args.num_prompts)
    except PromptFileError as err:
        ap.error(f"--prompts: {err}")
    if not rows:
        ap.error(f"--prompts {args.prompts}: no chat rows (with 'messages')")
    cfg = load_config(args.config)
    base_url = f"http://127.0.0.1:{cfg.serve.port}"
    results: dict = {"engine": {}, "served": {}}

    proc = start_server(args.config, base_url)  # first, so the engine below is built after Ray's start-up
    try:
        engine = build_engine(cfg)
        ids = [engine.encode_chat(r.messages) for r in rows]
        for mode in modes or ["spec"]:  # warm-up, uncounted: every prompt once per mode and concurrency on
            for c in levels:  # both sides (the first steps of each prompt length and batch size on a
                # process are slower: thread-count probes, first-touch memory)
                engine_closed_loop(engine, ids, len(ids), c, mode, 8, cfg.speculation)
                served_run(base_url, cfg.model.name, rows, len(rows), c, None if mode == "default" else mode, 8)
        runs: dict = {"engine": {}, "served": {}}
        for rnd in range(args.rounds):  # engine and served alternate, so machine drift hits both alike
            for mode in modes:
                for c in levels:
                    n = max(len(rows), 2 * c)
                    key = f"{mode} c={c}"
                    e = engine_closed_loop(engine, ids, n, c, mode, args.max_tokens, cfg.speculation)
                    s = served_run(base_url, cfg.model.name, rows, n, c, None if mode == "default" else mode,
                                   args.max_tokens)
                    runs["engine"].setdefault(key, []).append(e)
                    runs["served"].setdefault(key, []).append(s)
                    print(f"round {rnd + 1} {key}: engine {e['output_throughput']:.1f} tok/s, served "
                          f"{s['output_throughput']:.1f} tok/s", flush=True)
            results["engine"].setdefault("ttft_s", []).extend(engine_ttft(engine, args.ttft_runs))
            results["served"].setdefault("ttft_s", []).extend(served_ttft(base_url, cfg.model.name, args.ttft_runs))
            results["served"].setdefault("ttft_sync_client_s", []).extend(
                served_ttft_sync(base_url, cfg.model.name, args.ttft_runs))
        for side in ("engine", "served"):
            for key, rs in runs[side].items():  # means over the rounds
                results[side][key] = {k: statistics.mean(r[k] for r in rs) for k in rs[0]}
                results[side][key]["runs_tok_s"] = [r["output_throughput"] for r in rs]
        engine.close()
    finally:
        stop_server(proc)

    flags = {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")}
    lines = [f"config {args.config}, {len(rows)} prompts from {Path(args.prompts).name}, greedy, "
             f"max_tokens {args.max_tokens}, mean of {args.rounds} alternating rounds"
             + (f", server env {flags}" if flags else ""), "",
             "| mode | concurrency | engine tok/s | served tok/s | served / engine | engine TTFT p50 ms | served TTFT p50 ms |",
             "|---|---|---|---|---|---|---|"]
    for mode in modes:
        for c in levels:
            e, s = results["engine"][f"{mode} c={c}"], results["served"][f"{mode} c={c}"]
            ratio = s["output_throughput"] / e["output_throughput"]
            results["served"][f"{mode} c={c}"]["vs_engine"] = ratio
            lines.append(f"| {mode} | {c} | {e['output_throughput']:.1f} | {s['output_throughput']:.1f} | "
                         f"{ratio:.2f}x | {e['ttft_p50_ms']:.0f} | {s['ttft_p50_ms']:.0f} |")
    e_ttft = 1e3 * statistics.median(results["engine"]["ttft_s"])
    s_ttft = 1e3 * statistics.median(results["served"]["ttft_s"])
    sync_ttft = 1e3 * statistics.median(results["served"]["ttft_sync_client_s"])
    lines += ["", f"TTFT at low load (short chat prompt, max_tokens 1, {args.ttft_runs} sequential requests per round, "
              f"p50): engine {e_ttft:.1f} ms, served {s_ttft:.1f} ms (+{s_ttft - e_ttft:.1f} ms) with the load "
              f"generator's asyncio client, {sync_ttft:.1f} ms (+{sync_ttft - e_ttft:.1f} ms) with a synchronous httpx client"]
    table = "\n".join(lines)
    print(table)
    write_report(args.out, table, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
