"""Soak test: start ``rdserve up`` on loopback, measure its capacity, then run a mixed load at a share of
it for a bounded time, and stop it with SIGTERM while streams are in flight (graceful drain).

Mix: chat and text completions, streamed and not, streams the client cancels part-way, and bad
requests. Every request ends in one outcome:

- ``ok``: a complete response (non-streamed: a ``finish_reason`` and usage; streamed: the finishing
  chunk and ``[DONE]``);
- ``cancelled``: a stream the soak client closed on purpose;
- ``rejected``: a bad request answered 4xx with an OpenAI error;
- ``shed``: 503 with ``Retry-After`` (queue full, or draining);
- ``timeout``: 504 or a ``timeout`` error event (``serve.request_timeout_s``);
- ``aborted``: a ``shutdown`` error event (the final drain ran out of time);
- ``lost``: anything else (no response, 5xx other than 503/504, a stream without ``[DONE]``, a bad
  request accepted, a good one rejected). A healthy server loses none.

Reported: outcomes, latency percentiles per time window, the resident memory (RSS) of every process
of the rdserve process tree (driver, GCS, raylet, Serve controller, proxy, ingress, engine replicas,
MPI ranks) over time with its slope in MB per 1,000 requests, the KV cache's free blocks at the end,
and the exit code after SIGTERM.

    python benchmarks/soak.py --config configs/local.yaml --duration 1800 --out benchmarks/results/soak.json

Loopback only: the server binds 127.0.0.1 on a free port whatever the config says.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from bench_ports import free_port

REPO = Path(__file__).resolve().parents[1]
KINDS = {"chat": 0.25, "text": 0.2, "chat_stream": 0.2, "text_stream": 0.15, "cancel": 0.1, "bad": 0.1}
BAD = [  # (path, body): each must be answered 4xx
    ("/v1/completions", {"prompt": "a", "temperature": -1}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/completions", {"prompt": "a", "max_tokens": "5"}),
    ("/v1/completions", {"prompt": "a", "model": "no-such-model"}),
    ("/v1/completions", {"prompt": "x" * 200_000}),
    ("/v1/completions", b'{"prompt": "a",'),
]
CLIENT_TIMEOUT_S = 120.0


def start_server(config: Path, workdir: Path, request_timeout_s: float = 0) -> tuple[subprocess.Popen, str, dict]:
    """``rdserve up`` on a copy of ``config`` bound to 127.0.0.1:free port; (process, base URL, config).
    ``request_timeout_s`` (when > 0) becomes ``serve.request_timeout_s`` if the config sets none."""
    sys.path.insert(0, str(REPO))
    from cluster.config import load_config

    raw = yaml.safe_load(config.read_text()) or {}
    data = load_config(config).model_dump(mode="json")  # paths resolved against the config's directory
    if isinstance((raw.get("serve") or {}).get("api_keys"), list):
        data["serve"]["api_keys"] = raw["serve"]["api_keys"]  # a dump masks listed keys
    port = free_port()
    data["serve"].update(host="127.0.0.1", port=port)
    if data["serve"].get("request_timeout_s") is None and request_timeout_s:
        data["serve"]["request_timeout_s"] = request_timeout_s  # the server answers before the client gives up
    copy = workdir / "soak.yaml"
    copy.write_text(yaml.safe_dump(data))
    env = {**os.environ, "RAY_TMPDIR": str(workdir / "ray")}
    rdserve = Path(sys.executable).with_name("rdserve")
    proc = subprocess.Popen([str(rdserve), "up", "--config", str(copy)], cwd=REPO, env=env,
                            stdout=open(workdir / "rdserve.log", "w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", data


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rdserve up exited with {proc.returncode} before it was healthy")
        try:
            resp = httpx.get(f"{url}/health", timeout=10)
            if resp.status_code == 200:
                return resp.json()
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url}/health not ready within {timeout_s:.0f} s")


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def rss_mb(pids: list[int]) -> dict[str, float]:
    """``{"pid name": RSS in MB}``; the name is the process title (Ray sets ``ray::ServeReplica:...``)."""
    out = {}
    for pid in pids:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        # Ray's title is ray::<actor>.<current task>: keep the actor
        name = title.split()[0].split(".")[0] if title.startswith("ray::") else " ".join(title.split()[:3])[:80]
        out[f"{pid} {name}"] = rss / 1024
    return out


def is_done(line: str) -> bool:
    return line == "data: [DONE]"


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random, model: str) -> tuple[str, float, float | None]:
    """Send one request of ``kind``; (outcome, latency s, TTFT s or None)."""
    start = time.perf_counter()
    max_tokens = rng.randint(8, 64)
    if kind == "bad":
        path, body = rng.choice(BAD)
        try:
            resp = await (client.post(path, content=body, headers={"content-type": "application/json"})
                          if isinstance(body, bytes) else client.post(path, json={**body}))
            ok = 400 <= resp.status_code < 500 and "message" in resp.json().get("error", {})
            return ("rejected" if ok else "lost"), time.perf_counter() - start, None
        except (httpx.HTTPError, ValueError):
            return "lost", time.perf_counter() - start, None
    chat = kind.startswith("chat")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": model, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8]),
            **({"messages": [{"role": "user", "content": f"Tell me about {rng.randint(0, 10**6)}."}]} if chat
               else {"prompt": f"Request {rng.randint(0, 10**6)}: once upon a time"})}
    try:
        if "stream" not in kind and kind != "cancel":
            resp = await client.post(path, json=body)
            return _status_outcome(resp), time.perf_counter() - start, None
        stop_after = rng.randint(1, 4) if kind == "cancel" else None
        ttft, events = None, 0
        async with client.stream("POST", path, json={**body, "stream": True}) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return _status_outcome(resp), time.perf_counter() - start, None
            lines = [line async for line in _data_lines(resp, stop_after)]
            ttft = time.perf_counter() - start if lines else None
            events = len(lines)
        if stop_after is not None and events >= stop_after and not (lines and is_done(lines[-1])):
            return "cancelled", time.perf_counter() - start, ttft
        return _stream_outcome(lines), time.perf_counter() - start, ttft
    except httpx.HTTPError:
        return "lost", time.perf_counter() - start, None


async def _data_lines(resp: httpx.Response, stop_after: int | None):
    n = 0
    async for line in resp.aiter_lines():
        if line.startswith("data: "):
            yield line
            n += 1
            if stop_after is not None and n >= stop_after:
                return  # closing the response cancels the request on the server


def _status_outcome(resp: httpx.Response) -> str:
    if resp.status_code == 200:
        try:
            choice = resp.json()["choices"][0]
            return "ok" if choice["finish_reason"] in ("stop", "length") and resp.json()["usage"] else "lost"
        except (ValueError, KeyError, IndexError):
            return "lost"
    if resp.status_code == 503 and resp.headers.get("retry-after"):
        return "shed"
    return "timeout" if resp.status_code == 504 else "lost"


def _stream_outcome(lines: list[str]) -> str:
    if not lines or not is_done(lines[-1]):
        return "lost"
    for line in lines[:-1]:
        payload = json.loads(line[6:])
        if "error" in payload:
            code = payload["error"].get("code")
            return {"timeout": "timeout", "shutdown": "aborted"}.get(code, "lost")
        if any(c.get("finish_reason") for c in payload.get("choices", [])):
            return "ok"
    return "lost"


def choose(rng: random.Random, kinds: dict[str, float]) -> str:
    return rng.choices(list(kinds), weights=list(kinds.values()))[0]


async def measure_capacity(client: httpx.AsyncClient, seconds: float, concurrency: int, model: str) -> float:
    """Completed requests per second of a closed loop of ``concurrency`` clients (good requests only)."""
    done, stop_at = 0, time.monotonic() + seconds
    good = {k: w for k, w in KINDS.items() if k not in ("bad", "cancel")}

    async def worker(seed: int) -> None:
        nonlocal done
        rng = random.Random(seed)
        while time.monotonic() < stop_at:
            if (await one_request(client, choose(rng, good), rng, model))[0] == "ok":
                done += 1

    start = time.monotonic()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return done / (time.monotonic() - start)


async def run_load(client: httpx.AsyncClient, rate: float, duration_s: float, max_requests: int, model: str,
                   root_pid: int, sample_s: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Poisson arrivals at ``rate`` requests/s; (one record per request, RSS samples)."""
    rng = random.Random(seed)
    records: list[dict] = []
    samples: list[dict] = []
    tasks: set[asyncio.Task] = set()
    t0 = time.monotonic()

    async def send(kind: str, r: random.Random) -> None:
        sent = time.monotonic() - t0
        outcome, latency, ttft = await one_request(client, kind, r, model)
        records.append({"t": round(sent, 3), "kind": kind, "outcome": outcome, "latency_s": round(latency, 4),
                        "ttft_s": None if ttft is None else round(ttft, 4)})

    async def sampler() -> None:
        while True:
            samples.append({"t": round(time.monotonic() - t0, 1), "requests": len(records),
                            "rss_mb": rss_mb(process_tree(root_pid))})
            outcomes = {o: sum(r["outcome"] == o for r in records) for o in {r["outcome"] for r in records}}
            print(f"[{samples[-1]['t']:7.1f} s] {len(records)} done, in flight {len(tasks)}, {outcomes}, "
                  f"RSS {sum(samples[-1]['rss_mb'].values()):.0f} MB", flush=True)
            await asyncio.sleep(sample_s)

    sampling = asyncio.ensure_future(sampler())
    n = 0
    while time.monotonic() - t0 < duration_s and n < max_requests:
        task = asyncio.ensure_future(send(choose(rng, KINDS), random.Random(rng.random())))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        n += 1
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    samples.append({"t": round(time.monotonic() - t0, 1), "requests": len(records),
                    "rss_mb": rss_mb(process_tree(root_pid))})
    sampling.cancel()
    return records, samples


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"p50": round(q[49], 4), "p90": round(q[89], 4), "p99": round(q[98], 4), "n": len(values)}


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (0 with fewer than 3 points or no spread)."""
    if len(xs) < 3 or max(xs) == min(xs):
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def memory_report(samples: list[dict], warmup_share: float = 0.25) -> dict:
    """RSS per process (first/last MB) and slopes in MB per 1,000 requests after the warm-up share."""
    kept = samples[int(len(samples) * warmup_share):]
    names = sorted({name for s in samples for name in s["rss_mb"]})
    per_process = {}
    for name in names:
        points = [(s["requests"] / 1000, s["rss_mb"][name]) for s in kept if name in s["rss_mb"]]
        per_process[name] = {"first_mb": round(next(s["rss_mb"][name] for s in samples if name in s["rss_mb"]), 1),
                             "last_mb": round(points[-1][1], 1) if points else None,
                             "slope_mb_per_1k": round(slope(*zip(*points)), 2) if len(points) >= 3 else None}
    totals = [(s["requests"] / 1000, sum(s["rss_mb"].values())) for s in kept]
    return {"per_process": per_process, "total_first_mb": round(sum(samples[0]["rss_mb"].values()), 1),
            "total_last_mb": round(totals[-1][1], 1) if totals else None,
            "total_slope_mb_per_1k": round(slope(*zip(*totals)), 2) if len(totals) >= 3 else None}


def windows(records: list[dict], window_s: float) -> list[dict]:
    out = []
    end = max((r["t"] for r in records), default=0)
    t = 0.0
    while t <= end:
        rs = [r for r in records if t <= r["t"] < t + window_s]
        out.append({"t": t, "sent": len(rs), "latency_s": percentiles([r["latency_s"] for r in rs if r["outcome"] == "ok"]),
                    "ttft_s": percentiles([r["ttft_s"] for r in rs if r["outcome"] == "ok" and r["ttft_s"] is not None])})
        t += window_s
    return out


async def final_health(url: str, headers: dict, timeout_s: float = 60) -> dict:
    """Health once nothing is held (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
        while True:
            health = (await client.get("/health")).json()
            if health.get("load") == 0 or time.monotonic() > deadline:
                return health
            await asyncio.sleep(0.5)


async def drain_phase(url: str, headers: dict, proc: subprocess.Popen, streams: int, model: str,
                      exit_timeout_s: float) -> dict:
    """SIGTERM with ``streams`` long streams in flight: each must finish or end with a ``shutdown`` error
    event; a new request meanwhile must get 503 + Retry-After (or find the port closed); exit code 0."""
    body = {"model": model, "prompt": "A long story:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=CLIENT_TIMEOUT_S) as client:
        firsts = [asyncio.Event() for _ in range(streams)]

        async def stream(first: asyncio.Event) -> str:
            try:
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    lines = []
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line)
                            first.set()
                    return _stream_outcome(lines) if resp.status_code == 200 else _status_outcome(resp)
            except httpx.HTTPError:
                return "lost"
            finally:
                first.set()

        tasks = [asyncio.ensure_future(stream(f)) for f in firsts]
        await asyncio.gather(*(f.wait() for f in firsts))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        refused = None
        for _ in range(50):  # until the ingress drains (or the port closes)
            await asyncio.sleep(0.1)
            try:
                resp = await client.post("/v1/completions", json={"model": model, "prompt": "late", "max_tokens": 2})
            except httpx.HTTPError:
                refused = {"status": "connection refused"}
                break
            if resp.status_code == 503:
                refused = {"status": 503, "retry_after": resp.headers.get("retry-after"),
                           "message": resp.json()["error"]["message"]}
                break
        outcomes = await asyncio.gather(*tasks)
    code = await asyncio.to_thread(proc.wait, exit_timeout_s)
    return {"streams": list(outcomes), "new_request": refused, "exit_code": code,
            "stop_s": round(time.monotonic() - t0, 1)}


async def soak(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="soak", dir="/tmp"))
    proc, url, cfg = start_server(args.config, workdir, args.request_timeout_s)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = cfg["model"]["name"]
    try:
        print(f"rdserve up (pid {proc.pid}) at {url}; log {workdir / 'rdserve.log'}", flush=True)
        await asyncio.to_thread(wait_healthy, url, proc)
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
            capacity = args.capacity or await measure_capacity(client, args.calibrate_s, args.concurrency, model)
            rate = args.load * capacity
            print(f"capacity {capacity:.2f} requests/s; soaking at {rate:.2f}/s for {args.duration:.0f} s "
                  f"(at most {args.max_requests} requests)", flush=True)
            records, samples = await run_load(client, rate, args.duration, args.max_requests, model, proc.pid,
                                              args.sample_s, args.seed)
        health = await final_health(url, headers)
        drain = await drain_phase(url, headers, proc, args.drain_streams, model,
                                  cfg["serve"]["drain_timeout_s"] + 120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
        server_logs = server_log_counts(workdir)
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
    outcomes = {o: sum(r["outcome"] == o for r in records) for o in sorted({r["outcome"] for r in records})}
    kv = health.get("kv_cache", {})
    return {"config": str(args.config), "capacity_rps": round(capacity, 3), "rate_rps": round(rate, 3),
            "duration_s": args.duration, "requests": len(records), "outcomes": outcomes,
            "lost": outcomes.get("lost", 0), "windows": windows(records, args.window_s),
            "memory": memory_report(samples), "rss_samples": samples,
            "kv_end": {"free_blocks": kv.get("free_blocks"), "blocks": kv.get("blocks"), "load": health.get("load")},
            "drain": drain, "server_logs": server_logs}


LOG_PATTERNS = {"cancelled_by_client": "cancelled by the client", "drained": "drained: ",
                "never_retrieved": "Future exception was never retrieved"}


def server_log_counts(workdir: Path) -> dict[str, int]:
    """Lines of the server's Ray session logs (after it exited) matching each of ``LOG_PATTERNS``: the
    ingress's INFO lines must reach the files (Serve's throughput mode buffers replica logs)."""
    counts = dict.fromkeys(LOG_PATTERNS, 0)
    for path in (workdir / "ray").rglob("*"):
        if path.is_file() and path.suffix in (".log", ".err", ".out"):
            text = path.read_text(errors="replace")
            for name, pattern in LOG_PATTERNS.items():
                counts[name] += text.count(pattern)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "local.yaml", help="rdserve YAML config")
    parser.add_argument("--duration", type=float, default=1800, help="seconds of load (bounded)")
    parser.add_argument("--max-requests", type=int, default=200_000, help="stop sending after this many")
    parser.add_argument("--load", type=float, default=0.8, help="share of the measured capacity to send")
    parser.add_argument("--capacity", type=float, default=None, help="requests/s; skips the measurement")
    parser.add_argument("--calibrate-s", type=float, default=30, help="seconds of closed-loop capacity measurement")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop clients measuring capacity")
    parser.add_argument("--sample-s", type=float, default=10, help="seconds between RSS samples")
    parser.add_argument("--window-s", type=float, default=60, help="latency percentile window")
    parser.add_argument("--request-timeout-s", type=float, default=60,
                        help=f"serve.request_timeout_s when the config sets none (0: keep none). Under "
                        f"{CLIENT_TIMEOUT_S:.0f} s, so an overloaded server answers 504 (outcome 'timeout') before the "
                        "client gives up (outcome 'lost')")
    parser.add_argument("--drain-streams", type=int, default=4, help="streams in flight at the final SIGTERM")
    parser.add_argument("--api-key", default=os.environ.get("RDSERVE_API_KEY"), help="if serve.api_keys is set")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-logs", action="store_true", help="keep the server log and Ray's temp dir")
    parser.add_argument("--out", type=Path, default=None, help="write the full report (JSON) here")
    args = parser.parse_args()
    report = asyncio.run(soak(args))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    summary = {k: report[k] for k in ("capacity_rps", "rate_rps", "requests", "outcomes", "kv_end", "drain")}
    summary["memory"] = {k: v for k, v in report["memory"].items() if k != "per_process"}
    print(json.dumps(summary, indent=1))
    for w in report["windows"]:
        print(f"t {w['t']:6.0f} s: {w['sent']:5d} sent, latency {w['latency_s']}, TTFT {w['ttft_s']}")


if __name__ == "__main__":
    main()
