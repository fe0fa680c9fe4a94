"""Where the CPU goes while `rdserve up` serves: per process, CPU share, thread wake-ups and
preemptions, idle and under a closed-loop load.

On a small CPU machine the engine's OpenMP threads spin on every core, so each wake-up of another
thread (Ray's processes, the ingress, the client) preempts one of them, and the other waits for it
at the next barrier: a served step costs more than the same step in process. This script measures
that side by side: it starts ``rdserve up --config CONFIG`` as a subprocess, samples every thread
of every process in ``/proc`` (``utime+stime``, ``voluntary_ctxt_switches`` = wake-ups,
``nonvoluntary_ctxt_switches`` = preemptions) over a window with no traffic, then over a window of
closed-loop streaming load (``--concurrency``, ``--mode``), and reads the engine's mean iteration
time from the server's ``/metrics`` (``rdserve_iteration_seconds``). Linux only. Prints Markdown
tables and writes JSON.

Usage:
    python benchmarks/served_cpu.py --config configs/local.yaml --prompts ../shared/datasets/broad/dev.jsonl \\
        --concurrency 1 --mode plain --window 6 --out benchmarks/results/served_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cluster.config import load_config  # noqa: E402
from cluster.evaluation.loadgen import LoadSpec, run_load  # noqa: E402
from cluster.evaluation.prompts import load_prompts  # noqa: E402
from served_vs_engine import start_server, stop_server  # noqa: E402  (benchmarks/ is on sys.path as a script)

HZ = os.sysconf("SC_CLK_TCK")
METRICS_DELAY_S = 12.0


def process_label(pid: str) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
    if cmd.startswith("ray::"):
        return cmd.split()[0]
    parts = cmd.split()
    return " ".join(Path(parts[0]).name if i == 0 else p for i, p in enumerate(parts[:3])) if parts else ""


def snapshot() -> dict[tuple[str, str], tuple[str, float, int, int]]:
    """(pid, tid) -> (process label, CPU seconds, wake-ups, preemptions) for every thread."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        label = process_label(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            cpu = (int(fields[11]) + int(fields[12])) / HZ
            vol = int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))
            inv = int(re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))
            out[(pid, tid)] = (label or "(kernel or unnamed)", cpu, vol, inv)
    return out


def window(seconds: float) -> dict[str, dict]:
    """Per process label over ``seconds``: CPU % of one core, wake-ups/s, preemptions/s, threads."""
    a = snapshot()
    t0 = time.monotonic()
    time.sleep(seconds)
    b = snapshot()
    dt = time.monotonic() - t0
    procs: dict[str, dict] = {}
    for key, (label, cpu, vol, inv) in b.items():
        if key not in a:
            continue
        _, cpu0, vol0, inv0 = a[key]
        p = procs.setdefault(label, {"cpu_pct": 0.0, "wakeups_per_s": 0.0, "preemptions_per_s": 0.0,
                                     "busiest_thread_pct": 0.0, "busiest_thread_preemptions_per_s": 0.0})
        p["cpu_pct"] += 100 * (cpu - cpu0) / dt
        p["wakeups_per_s"] += (vol - vol0) / dt
        p["preemptions_per_s"] += (inv - inv0) / dt
        if 100 * (cpu - cpu0) / dt > p["busiest_thread_pct"]:
            p["busiest_thread_pct"] = 100 * (cpu - cpu0) / dt
            p["busiest_thread_preemptions_per_s"] = (inv - inv0) / dt
    return dict(sorted(procs.items(), key=lambda kv: -(kv[1]["wakeups_per_s"] + kv[1]["cpu_pct"])))


def iteration_time(base: str) -> dict[str, list[float]]:
    """Per iteration kind (context, plain, spec, mixed): [sum of seconds, count] of
    ``rdserve_iteration_seconds``, over all replicas."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if line.startswith("#") or "iteration_seconds_" not in line:
            continue
        kind = re.search(r'kind="(\w+)"', line)
        slot = out.setdefault(kind.group(1) if kind else "all", [0.0, 0.0])
        if "iteration_seconds_sum" in line:
            slot[0] += float(line.rsplit(" ", 1)[1])
        elif "iteration_seconds_count" in line:
            slot[1] += float(line.rsplit(" ", 1)[1])
    return out


def table(procs: dict[str, dict], top: int) -> str:
    rows = ["| process | CPU % of a core | wake-ups/s | preemptions/s | busiest thread % (its preemptions/s) |",
            "|---|---|---|---|---|"]
    for label, p in list(procs.items())[:top]:
        rows.append(f"| `{label[:60]}` | {p['cpu_pct']:.1f} | {p['wakeups_per_s']:.0f} | {p['preemptions_per_s']:.0f} | "
                    f"{p['busiest_thread_pct']:.0f} ({p['busiest_thread_preemptions_per_s']:.0f}) |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--prompts", required=True, help="prompt JSONL (chat rows), e.g. ../shared/datasets/broad/dev.jsonl")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--mode", default=None, help="rdserve.mode of every request (plain / spec); default: speculation.default_mode")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--window", type=float, default=10.0, help="seconds sampled idle and under load")
    ap.add_argument("--top", type=int, default=10, help="processes shown")
    ap.add_argument("--out", default="benchmarks/results/served_cpu")
    args = ap.parse_args()
    if not Path("/proc/self/task").exists():
        sys.exit("served_cpu.py reads /proc (Linux only)")

    cfg = load_config(args.config)
    base = f"http://127.0.0.1:{cfg.serve.port}"
    prompts = load_prompts(args.prompts)[: args.num_prompts]
    model = cfg.model.name
    server = start_server(args.config, base)
    try:
        run_load(base, prompts, LoadSpec(model=model, max_tokens=8, concurrency=2, max_requests=4), progress=False)
        time.sleep(3)
        print(f"idle window ({args.window:g} s)...", flush=True)
        idle = window(args.window)
        # closed loop for the window plus 2 s of ramp-up; requests still running at the end finish
        spec = LoadSpec(model=model, max_tokens=args.max_tokens, concurrency=args.concurrency, mode=args.mode,
                        duration_s=args.window + 2.0, max_requests=100_000)
        result: dict = {}
        it0 = iteration_time(base)
        thread = threading.Thread(target=lambda: result.update(run=run_load(base, prompts, spec, progress=False)),
                                  daemon=True)
        thread.start()
        time.sleep(2.0)
        print(f"load window ({args.window:g} s, concurrency {args.concurrency}, mode {args.mode or 'router'})...",
              flush=True)
        loaded = window(args.window)
        thread.join()
        time.sleep(METRICS_DELAY_S)  # Ray exports replica metrics periodically
        it1 = iteration_time(base)
        run = result["run"].summary()
        tokens, seconds = run["output_tokens"], run["duration_s"]
        iterations = {}
        for kind, (total, count) in it1.items():
            t0, c0 = it0.get(kind, [0.0, 0.0])
            if count > c0:
                iterations[kind] = {"count": count - c0, "mean_ms": 1000 * (total - t0) / (count - c0)}
        summary = {
            "output_tok_per_s": tokens / seconds if seconds else None,
            "iterations": iterations,
            "completed": run["completed"],
            "failed": run["failed"],
        }
    finally:
        stop_server(server)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "idle": idle, "load": loaded,
                                                    "summary": summary}, indent=1))
    text = (f"config {args.config}, {os.cpu_count()} CPUs\n\n**Idle** (no requests):\n\n{table(idle, args.top)}\n\n"
            f"**Under load** (concurrency {args.concurrency}, mode {args.mode or 'router'}, max_tokens "
            f"{args.max_tokens}): {summary['output_tok_per_s'] or 0:.1f} output tok/s over the run; engine iterations: "
            + ", ".join(f"{k} {v['mean_ms']:.1f} ms mean ({v['count']:.0f})" for k, v in iterations.items())
            + f"\n\n{table(loaded, args.top)}\n")
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
