"""Load generator for any OpenAI-compatible endpoint: streamed requests, timed per chunk.

Two arrival patterns (as in vLLM's ``bench serve``):
- closed loop: ``concurrency`` clients, each sends its next request when the previous one ends;
- open loop: requests arrive as a Poisson process of ``rate`` requests/s (exponential gaps,
  seeded), regardless of how many are still running.

A run is bounded twice: at most ``max_requests`` requests, and no new request after
``duration_s``; requests still running ``grace_s`` later are cancelled and recorded as failed, so a
run ends within ``duration_s + grace_s`` seconds whatever the server does. Request ``i`` uses
prompt ``i mod len(prompts)``.

Output tokens are counted with the model's tokenizer when ``count_tokens`` is given (the streamed
text, re-tokenized), else from the server's ``usage`` (``stream_options.include_usage``), else as
the number of content chunks.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np
from tqdm.auto import tqdm

from cluster.evaluation.metrics import Slo, summarize
from cluster.evaluation.prompts import PromptRow


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds, ``start_s`` since the run started."""

    index: int
    prompt_index: int
    category: str
    start_s: float
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    rdserve: dict | None = None
    logprobs: list[float] = field(default_factory=list)  # per output token, when the spec asked for them


@dataclass(frozen=True)
class LoadSpec:
    """What to send and how. Exactly one of ``concurrency`` (closed loop) and ``rate`` (open loop,
    requests/s). ``mode`` goes into the ``rdserve`` request extension (None = server default)."""

    model: str
    max_tokens: int = 128
    temperature: float = 0.0
    mode: str | None = None
    concurrency: int | None = 1
    rate: float | None = None
    max_requests: int = 64
    duration_s: float = 60.0
    grace_s: float = 30.0
    seed: int = 0
    request_timeout_s: float = 300.0
    logprobs: bool = False

    def __post_init__(self):
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) and rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")

    @property
    def label(self) -> str:
        load = f"c={self.concurrency}" if self.concurrency is not None else f"rate={self.rate:g}/s"
        return f"{self.mode or 'default'} {load}"


@dataclass
class RunResult:
    spec: LoadSpec
    records: list[RequestRecord]
    duration_s: float

    def summary(self, slo: Slo | None = None) -> dict:
        return summarize(self.records, self.duration_s, slo)

    def as_dict(self, slo: Slo | None = None, with_records: bool = False) -> dict:
        out = {"spec": asdict(self.spec), "summary": self.summary(slo)}
        if with_records:
            out["records"] = [asdict(r) for r in self.records]
        return out


def run_load(base_url: str, prompts: Sequence[PromptRow], spec: LoadSpec,
             count_tokens: Callable[[str], int] | None = None, progress: bool = True) -> RunResult:
    """Run one load test against ``base_url`` (e.g. ``http://127.0.0.1:8000``); blocks until done."""
    return asyncio.run(run_load_async(base_url, prompts, spec, count_tokens, progress))


async def run_load_async(base_url: str, prompts: Sequence[PromptRow], spec: LoadSpec,
                         count_tokens: Callable[[str], int] | None = None, progress: bool = True) -> RunResult:
    if not prompts:
        raise ValueError("no prompts")
    records: list[RequestRecord] = []
    bar = tqdm(total=spec.max_requests, desc=spec.label, disable=not progress, leave=False)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=spec.concurrency or 64)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=spec.request_timeout_s, limits=limits) as client:

        async def send(i: int) -> None:
            row = prompts[i % len(prompts)]
            rec = RequestRecord(i, i % len(prompts), row.category, time.perf_counter() - t0)
            records.append(rec)
            body = row.body(spec.model, spec.max_tokens, temperature=spec.temperature, mode=spec.mode,
                            seed=spec.seed + i if spec.temperature > 0 else None, stream=True,
                            logprobs=spec.logprobs)
            await _timed_request(client, row.path, body, rec, count_tokens)
            bar.update()

        issuing = _closed_loop(send, spec, t0) if spec.concurrency is not None else _open_loop(send, spec, t0)
        task = asyncio.ensure_future(issuing)
        done, _ = await asyncio.wait({task}, timeout=spec.duration_s + spec.grace_s)
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif task.exception() is not None:
            raise task.exception()
    bar.close()
    return RunResult(spec, sorted(records, key=lambda r: r.index), time.perf_counter() - t0)


async def _closed_loop(send, spec: LoadSpec, t0: float) -> None:
    counter = itertools.count()

    async def client_loop() -> None:
        while (i := next(counter)) < spec.max_requests and time.perf_counter() - t0 < spec.duration_s:
            await send(i)

    await asyncio.gather(*(client_loop() for _ in range(spec.concurrency)))


async def _open_loop(send, spec: LoadSpec, t0: float) -> None:
    gaps = np.random.default_rng(spec.seed).exponential(1.0 / spec.rate, size=spec.max_requests)
    tasks = []
    for i, arrival in enumerate(np.cumsum(gaps)):
        if arrival >= spec.duration_s:
            break
        await asyncio.sleep(max(0.0, arrival - (time.perf_counter() - t0)))
        tasks.append(asyncio.ensure_future(send(i)))
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def _timed_request(client: httpx.AsyncClient, path: str, body: dict, rec: RequestRecord,
                         count_tokens: Callable[[str], int] | None) -> None:
    """Send one streamed request and fill ``rec``; never raises except on cancellation."""
    parts: list[str] = []
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                rec.usage = chunk.get("usage") or rec.usage
                rec.rdserve = chunk.get("rdserve") or rec.rdserve
                for choice in chunk.get("choices") or []:
                    text = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text:
                        if rec.ttft_s is None:
                            rec.ttft_s = now - start
                        else:
                            rec.itl_s.append(now - last)
                        last = now
                        parts.append(text)
                    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
                    lp = choice.get("logprobs") or {}
                    if lp.get("content") is not None:  # chat
                        rec.logprobs.extend(e["logprob"] for e in lp["content"])
                    elif lp.get("token_logprobs") is not None:  # completions
                        rec.logprobs.extend(lp["token_logprobs"])
        rec.latency_s = time.perf_counter() - start
        rec.text = "".join(parts)
        rec.output_tokens = _count(rec, parts, count_tokens)
        rec.ok = rec.ttft_s is not None or rec.finish_reason is not None
        if not rec.ok:
            rec.error = "stream ended without content or finish_reason"
    except asyncio.CancelledError:
        rec.error = "cancelled at the run's time limit"
        raise
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        rec.error = f"{type(err).__name__}: {err}"


def _count(rec: RequestRecord, parts: list[str], count_tokens: Callable[[str], int] | None) -> int:
    if count_tokens is not None:
        return count_tokens(rec.text)
    if rec.usage and "completion_tokens" in rec.usage:
        return int(rec.usage["completion_tokens"])
    return len(parts)
