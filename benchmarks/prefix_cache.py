"""Prefix caching on multi-turn chat: TTFT and cache hit rate with ``engine.enable_prefix_caching`` on vs off.

Conversations of ``--min-turns`` to ``--max-turns`` user turns (drawn from ``--seed``), each user turn a
chat prompt of ``--prompts`` (a prompt JSONL, read at run time; rows of at most ``--max-turn-tokens``
tokens; no two conversations open with the same prompt), all sharing one fixed system prompt of about
500 tokens (``SYSTEM_PROMPT``, an assistant policy; ``--system-prompt default`` sends none, so the chat
template's short default is all they share). A conversation is sequential: turn k's request
carries the system prompt, the earlier user turns, the assistant's earlier answers as the server
returned them, and the new user turn. Requests stream (``stream_options.include_usage``), temperature 0,
``--max-tokens``; turns that would not fit ``engine.max_seq_len`` are dropped from a conversation's end.

Closed loop over conversations: ``c`` clients, each runs one conversation to its end and then takes the
next, for each ``c`` of ``--concurrency``. Two copies of CONFIG, on free ports: one with
``engine: {enable_prefix_caching: true}`` merged in (the default), one with ``false``. Each (caching,
concurrency) runs the same conversations on a freshly started ``rdserve up``, so a level finds no
blocks cached by an earlier one (a second pass over the same conversations would hit them); caching
on and off alternate first from level to level, so machine drift hits both.

Per (caching, concurrency): TTFT (request sent to first streamed content) p50/p90 over all requests and
p50 by turn (1, 2, 3, 4+), output tokens/s (completion tokens / the level's wall time), the cache hit
rate (sum ``usage.prompt_tokens_details.cached_tokens`` / sum ``usage.prompt_tokens``) and the same
ratio from the server's ``ray_rdserve_prefix_cache_hits_total / ..._queries_total`` (warm-up
excluded; "-" when /metrics does not show them in time), and ``/health``'s ``kv_cache.cached_blocks``
after the level. Per concurrency: TTFT p50 at turns >= 4, caching on / off (target <= 0.3x at
concurrency 1), and the (conversation, turn) answers that differ between on and off (greedy; 0
expected: caching on prefills only a prompt's uncached suffix, and every prompt row is computed the
same way whatever its chunk, also on the int8-activation path; before ``c55722a`` SDPA's chunk-shaped
rounding flipped near-ties there). Prints Markdown tables naming the CPU and the compute path (``/health``'s ``compute_path``),
writes JSON with the command line (per-request records name each user turn by its line in
``--prompts``; no prompt or answer text).

Usage:
    python benchmarks/prefix_cache.py --config configs/local.yaml \\
        --prompts ../shared/datasets/broad/dev.jsonl --num-conversations 32 --concurrency 1,4,16 \\
        --out benchmarks/results/prefix_cache
    python benchmarks/prefix_cache.py --num-conversations 2 --min-turns 4 --max-turns 4 \\
        --concurrency 1 --max-tokens 8 --out /tmp/prefix_cache_smoke          # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import yaml
from bench_ports import free_port
from bench_prompts import DATASETS
from bench_report import write_report
from bench_serve import absolute_paths
from served_vs_engine import start_server, stop_server

from cluster.config import load_config
from workers.kernels.build import cpu_model

SYSTEM_PROMPT = """\
You are Atlas, the assistant of Northwind Library Services, a public library network with twelve \
branches, a mobile library and an online catalogue. You answer questions from members of the public in \
a chat window on the library's website. Follow this policy in every answer.

Tone and form. Be friendly, plain and brief. Answer the question first, then add at most two sentences \
of context when they help. Use short paragraphs or a short list; avoid headings. Write in the language \
the member writes in. Never invent facts: when you do not know something, say so and suggest where to \
find it.

General questions. Members may ask about anything: homework, writing, cooking, travel, science, history \
or everyday problems. Help them as a knowledgeable reference librarian would: explain clearly, show the \
steps of a calculation, name the kind of source that would confirm an answer, and point out when a \
question has more than one reasonable answer. When a member asks you to summarize, classify, rewrite or \
answer questions about a text they paste, work only from that text.

Library services. Members may borrow up to twenty items at once. Books are lent for three weeks, films \
and games for one week, and items can be renewed twice online unless another member has reserved them. \
There are no late fees for children's items; for other items the fee is twenty cents a day, at most \
five dollars per item. A library card is free for anyone who lives, works or studies in the county; \
others pay twenty dollars a year. The online catalogue, e-books, audiobooks and language courses are \
available around the clock with a card number and PIN. Branches open Monday to Saturday from 9 am to \
7 pm and Sunday from noon to 5 pm, except on public holidays.

Privacy and safety. Never ask for or repeat a member's card number, PIN, address, phone number or \
borrowing history. If a member shares such data, tell them not to share it in the chat. Do not give \
medical, legal or financial advice beyond general information; suggest a qualified professional \
instead. If someone seems to be in danger, give the emergency number 911 first.

Limits. You cannot place holds, renew items, change accounts or take payments yourself; explain how the \
member can do it online or at the front desk. When a question is outside what you can do, say so \
politely and offer the best next step."""
TURN_BUCKETS = (("1", 1, 1), ("2", 2, 2), ("3", 3, 3), ("4+", 4, 10**9))
COUNTERS = ("ray_rdserve_prefix_cache_queries_total", "ray_rdserve_prefix_cache_hits_total")
ANSWER_SLACK_TOKENS = 4  # an answer re-tokenized from its text may take a few more tokens than were generated


def user_turns(path: str, tokenizer, max_turn_tokens: int) -> list[tuple[int, str]]:
    """(line number, text) of the rows of prompt JSONL ``path`` that are one user message of at most
    ``max_turn_tokens`` tokens."""
    out = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        messages = json.loads(line).get("messages") or []
        if len(messages) == 1 and messages[0].get("role") == "user":
            text = messages[0]["content"]
            if len(tokenizer.encode(text, add_special_tokens=False)) <= max_turn_tokens:
                out.append((line_no, text))
    return out


def conversations(pool: list[tuple[int, str]], args, tokenizer, max_seq_len: int) -> list[dict]:
    """``args.num_conversations`` conversations ``{"id", "lines", "turns"}`` (user turns as (line, text)),
    the same for the same ``args.seed``: distinct first turns, distinct turns within a conversation; the
    last turns are dropped while the last request's prompt plus ``args.max_tokens`` could exceed
    ``max_seq_len`` (each earlier answer counted at ``args.max_tokens`` + slack tokens).

    Raises:
        SystemExit: fewer usable prompts than conversations or turns, or ``--min-turns`` turns do not fit.
    """
    from workers.models.tokenizer import apply_chat_template

    if len(pool) < max(args.num_conversations, args.max_turns):
        raise SystemExit(f"{args.prompts}: {len(pool)} single-turn chat prompts of at most {args.max_turn_tokens} "
                         f"tokens; need {max(args.num_conversations, args.max_turns)}")
    rng = random.Random(args.seed)
    firsts = rng.sample(range(len(pool)), args.num_conversations)
    out = []
    for cid, first in enumerate(firsts):
        n = rng.randint(args.min_turns, args.max_turns)
        rest = rng.sample([i for i in range(len(pool)) if i != first], n - 1)
        turns = [pool[i] for i in [first, *rest]]
        while True:
            messages = opening(args)
            for _, text in turns:
                messages += [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
            worst = (len(apply_chat_template(tokenizer, messages[:-1]))
                     + (len(turns) - 1) * (args.max_tokens + ANSWER_SLACK_TOKENS) + args.max_tokens)
            if worst <= max_seq_len:
                break
            if len(turns) == args.min_turns:
                raise SystemExit(f"conversation {cid}: {args.min_turns} turns may need {worst} tokens, more than "
                                 f"max_seq_len {max_seq_len}: lower --max-tokens or --max-turn-tokens")
            turns = turns[:-1]
        out.append({"id": cid, "lines": [line for line, _ in turns], "turns": [text for _, text in turns]})
    return out


def variant_config(config: Path, caching: bool, out_dir: Path) -> tuple[Path, int]:
    """CONFIG with ``engine.enable_prefix_caching`` set to ``caching``, free HTTP and metrics ports, and
    its relative paths made absolute (the copy lives elsewhere); returns the copy's path and HTTP port."""
    data = absolute_paths(yaml.safe_load(config.read_text()) or {}, config.resolve().parent)
    data["engine"] = {**(data.get("engine") or {}), "enable_prefix_caching": caching}
    port = free_port()
    data.setdefault("serve", {})["port"] = port
    data["observability"] = {**(data.get("observability") or {}), "metrics_port": free_port()}
    path = out_dir / f"prefix_caching_{'on' if caching else 'off'}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    load_config(path)  # fail here, naming the field, rather than in the server
    return path, port


async def stream_chat(client: httpx.AsyncClient, body: dict) -> dict:
    """One streamed chat request: ``ttft_s`` (to the first content chunk; None without content),
    ``latency_s``, ``text``, ``finish_reason``, ``usage`` and the ``rdserve`` stats.

    Raises:
        RuntimeError: an HTTP error, an error event, or a stream without a usage chunk.
    """
    t0 = time.perf_counter()
    ttft, parts, usage, stats, finish = None, [], None, None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            usage = chunk.get("usage") or usage
            stats = chunk.get("rdserve") or stats
            for choice in chunk.get("choices") or []:
                if text := (choice.get("delta") or {}).get("content"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(text)
                finish = choice.get("finish_reason") or finish
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - t0, "text": "".join(parts),
            "finish_reason": finish, "usage": usage, "rdserve": stats}


async def run_level(base_url: str, model: str, convs: list[dict], concurrency: int, args) -> tuple[list[dict], float]:
    """Every conversation of ``convs``, ``concurrency`` at a time (closed loop; with ``args.think_s`` > 0
    a pause drawn from an exponential distribution of that mean between a conversation's turns); returns one record per
    request (``conversation``, ``turn`` from 1, ``start_s`` since the level began, and
    :func:`stream_chat`'s fields) and the level's wall time in seconds."""
    records: list[dict] = []
    queue = iter(convs)  # shared by the clients: each takes the next conversation when its last one ends
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def client_loop() -> None:
            for conv in queue:
                messages = opening(args)
                for turn, user in enumerate(conv["turns"], 1):
                    messages.append({"role": "user", "content": user})
                    body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
                    if args.mode:
                        body["rdserve"] = {"mode": args.mode}
                    start = time.perf_counter() - t0
                    r = await stream_chat(client, body)
                    records.append({"conversation": conv["id"], "turn": turn, "start_s": start, **r})
                    messages.append({"role": "assistant", "content": r["text"]})
                    think_s = getattr(args, "think_s", 0.0)
                    if think_s and turn < len(conv["turns"]):  # the user reads and types (seeded per turn)
                        await asyncio.sleep(random.Random(f"{args.seed}/{conv['id']}/{turn}").expovariate(1 / think_s))

        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return sorted(records, key=lambda r: (r["conversation"], r["turn"])), wall


def prefix_counters(base_url: str) -> dict | None:
    """Sums over series of ``COUNTERS`` on the server's /metrics; None when it shows neither."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return None
    sums, seen = dict.fromkeys(COUNTERS, 0.0), False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            rest = line[line.rindex("}") + 1:] if "}" in line else line[len(name):]
            sums[name] += float(rest.split()[0])
            seen = True
    return sums if seen else None


def wait_counters(base_url: str, min_queries: int, timeout_s: float = 30.0) -> dict | None:
    """:func:`prefix_counters` once its queries reach ``min_queries`` (the prompt tokens sent so far;
    Ray exports counters every few seconds); None if they do not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        c = prefix_counters(base_url)
        if c is not None and c[COUNTERS[0]] >= min_queries:
            return c
        if time.monotonic() > deadline:
            return None
        time.sleep(1.0)


def warm_up(base_url: str, model: str, args) -> int:
    """Two short requests that share no KV block with the conversations (the system prompt's text sent
    as a user turn, behind the chat template's default system prompt, and a greeting); returns their
    prompt tokens."""
    async def go() -> int:
        async with httpx.AsyncClient(base_url=base_url, timeout=args.timeout) as client:
            tokens = 0
            for content in (SYSTEM_PROMPT, "Hi! What is your name?"):
                body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
                        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
                tokens += (await stream_chat(client, body))["usage"]["prompt_tokens"]
            return tokens

    return asyncio.run(go())


def percentile_ms(values: list[float], q: float) -> float | None:
    return 1e3 * float(np.percentile(values, q)) if values else None


def summarize(records: list[dict], wall_s: float) -> dict:
    """A level's figures: TTFT p50/p90 (ms) and p50 by turn bucket, output tokens/s, usage hit rate."""
    def hit_rate(rs: list[dict]) -> float | None:
        prompt = sum(r["usage"]["prompt_tokens"] for r in rs)
        cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in rs)
        return cached / prompt if prompt else None

    ttft = [r["ttft_s"] for r in records if r["ttft_s"] is not None]
    out_tokens = sum(r["usage"]["completion_tokens"] for r in records)
    by_turn = {label: [r for r in records if lo <= r["turn"] <= hi] for label, lo, hi in TURN_BUCKETS}
    return {
        "requests": len(records), "requests_without_content": len(records) - len(ttft), "wall_s": wall_s,
        "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall_s,
        "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in records),
        "ttft_p50_ms": percentile_ms(ttft, 50), "ttft_p90_ms": percentile_ms(ttft, 90),
        "ttft_p50_ms_by_turn": {k: percentile_ms([r["ttft_s"] for r in rs if r["ttft_s"] is not None], 50)
                                for k, rs in by_turn.items()},
        "mean_prompt_tokens_by_turn": {k: float(np.mean([r["usage"]["prompt_tokens"] for r in rs])) if rs else None
                                       for k, rs in by_turn.items()},
        "hit_rate": hit_rate(records), "hit_rate_by_turn": {k: hit_rate(rs) for k, rs in by_turn.items()},
    }


def serve_level(config: Path, caching: bool, convs: list[dict], concurrency: int, model: str, tmp: Path,
                args) -> dict:
    """Start a server for ``config`` with caching on/off, warm it up, run the conversations at
    ``concurrency``, read /health and the prefix-cache counters, stop it; returns the level's summary
    plus ``records``, ``health`` and ``metrics_hit_rate``."""
    path, port = variant_config(config, caching, tmp)
    base_url = f"http://127.0.0.1:{port}"
    proc = start_server(str(path), base_url)
    try:
        warm_tokens = warm_up(base_url, model, args)
        before = wait_counters(base_url, warm_tokens)
        records, wall = asyncio.run(run_level(base_url, model, convs, concurrency, args))
        summary = summarize(records, wall)
        after = wait_counters(base_url, warm_tokens + summary["prompt_tokens"]) if before else None
        health = httpx.get(f"{base_url}/health", timeout=30.0).json()
    finally:
        stop_server(proc)
    queries, hits = COUNTERS
    summary["metrics_hit_rate"] = ((after[hits] - before[hits]) / (after[queries] - before[queries])
                                   if after and after[queries] > before[queries] else None)
    summary["health"] = {"compute_path": health.get("compute_path"), "kv_cache": health.get("kv_cache")}
    summary["records"] = [{k: v for k, v in r.items() if k != "text"} for r in records]
    summary["answers"] = {(r["conversation"], r["turn"]): r["text"] for r in records}
    return summary


def fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def report(args, results: dict, levels: list[int]) -> str:
    convs = results["conversations"]
    turns = [len(c["lines"]) for c in convs]
    lines = [f"CPU: {results['cpu']}; compute path: {results['compute_path']}; config {args.config}; "
             f"{len(convs)} conversations of {min(turns)}-{max(turns)} turns ({sum(turns)} requests per level) "
             f"from {Path(args.prompts).name}, system prompt {results['system_prompt_tokens']} tokens, greedy, "
             f"max_tokens {args.max_tokens}, mode {args.mode or 'server default'}; a fresh server per row", "",
             "| caching | concurrency | TTFT p50 ms | TTFT p90 ms | p50 turn 1 | p50 turn 2 | p50 turn 3 | "
             "p50 turn 4+ | output tok/s | hit rate (usage) | hit rate (/metrics) | cached blocks after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in levels:
        for side in ("on", "off"):
            s = results["levels"][f"{side} c={c}"]
            t = s["ttft_p50_ms_by_turn"]
            kv = s["health"]["kv_cache"] or {}
            lines.append(f"| {side} | {c} | {fmt(s['ttft_p50_ms'])} | {fmt(s['ttft_p90_ms'])} | {fmt(t['1'])} | "
                         f"{fmt(t['2'])} | {fmt(t['3'])} | {fmt(t['4+'])} | {s['output_tokens_per_s']:.1f} | "
                         f"{fmt(s['hit_rate'], '.1%')} | {fmt(s['metrics_hit_rate'], '.1%')} | "
                         f"{kv.get('cached_blocks', '-')} / {kv.get('blocks', '-')} |")
    lines += ["", "| concurrency | TTFT p50 turn 4+ on / off | target | output tok/s on / off | "
              "answers differing on vs off |", "|---|---|---|---|---|"]
    for c in levels:
        cmp = results["comparison"][f"c={c}"]
        lines.append(f"| {c} | {fmt(cmp['ttft_p50_turn4plus_ratio'], '.2f')}x | {'<= 0.3x' if c == 1 else '-'} | "
                     f"{fmt(cmp['output_tokens_per_s_ratio'], '.2f')}x | {len(cmp['answers_differing'])} of "
                     f"{sum(turns)} |")
    return "\n".join(lines)


def opening(args) -> list[dict]:
    """A conversation's first messages: the shared ~500-token system prompt (``--system-prompt policy``), or
    none (``default``: the chat template's own short default system prompt is the only shared prefix)."""
    return [{"role": "system", "content": SYSTEM_PROMPT}] if args.system_prompt == "policy" else []


def add_workload_options(ap: argparse.ArgumentParser, concurrency: str, num_conversations: int) -> None:
    """The options of the multi-turn workload (shared with ``benchmarks/prefix_routing.py``)."""
    ap.add_argument("--config", default="configs/local.yaml", help="rdserve config served")
    ap.add_argument("--prompts", default=str(DATASETS / "broad/dev.jsonl"), help="prompt JSONL whose single-turn "
                    "chat rows are the user turns")
    ap.add_argument("--num-conversations", type=int, default=num_conversations, help="conversations per row")
    ap.add_argument("--min-turns", type=int, default=4, help="user turns per conversation, at least")
    ap.add_argument("--max-turns", type=int, default=8, help="user turns per conversation, at most")
    ap.add_argument("--max-turn-tokens", type=int, default=128, help="longest user turn, in tokens")
    ap.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request (at most)")
    ap.add_argument("--concurrency", default=concurrency, help="comma-separated closed-loop concurrency levels "
                    "(conversations in flight)")
    ap.add_argument("--mode", choices=["auto", "spec", "plain"], help="rdserve.mode of every request "
                    "(default: the server's)")
    ap.add_argument("--think-s", type=float, default=0.0, help="mean seconds a user pauses between turns "
                    "(exponential, seeded); 0 = the next turn goes right after the answer")
    ap.add_argument("--system-prompt", choices=["policy", "default"], default="policy",
                    help="the prefix every conversation shares: 'policy', a ~500-token system prompt (the "
                         "issue's workload), or 'default', no system message (the chat template's short "
                         "default), so each conversation's own history is most of its prompt")
    ap.add_argument("--seed", type=int, default=0, help="draws the conversations")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def load_workload(ap: argparse.ArgumentParser, args) -> tuple:
    """``(config, concurrency levels, conversations, results skeleton)`` for parsed ``args`` of
    :func:`add_workload_options` (``ap.error`` on bad turn bounds)."""
    if not 1 <= args.min_turns <= args.max_turns:
        ap.error("need 1 <= --min-turns <= --max-turns")
    levels = [int(c) for c in args.concurrency.split(",")]

    from workers.models.pull import pull_default
    from workers.models.tokenizer import load_tokenizer

    cfg = load_config(args.config)
    tokenizer = load_tokenizer(cfg.model.path or pull_default())
    convs = conversations(user_turns(args.prompts, tokenizer, args.max_turn_tokens), args, tokenizer,
                          cfg.engine.max_seq_len)
    results: dict = {"command": shlex.join(["python", *sys.argv]), "cpu": cpu_model(), "args": vars(args),
                     "system_prompt_tokens": sum(len(tokenizer.encode(m["content"], add_special_tokens=False))
                                                 for m in opening(args)),
                     "conversations": [{"id": c["id"], "lines": c["lines"]} for c in convs], "levels": {},
                     "comparison": {}}
    return cfg, levels, convs, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_options(ap, concurrency="1,4,16", num_conversations=32)
    ap.add_argument("--out", default="benchmarks/results/prefix_cache", help="output path without suffix")
    args = ap.parse_args()
    cfg, levels, convs, results = load_workload(ap, args)
    answers: dict = {}
    with tempfile.TemporaryDirectory(prefix="rdserve-prefix-") as tmp:
        for i, c in enumerate(levels):
            for side in ("on", "off") if i % 2 == 0 else ("off", "on"):
                print(f"caching {side}, concurrency {c}: {len(convs)} conversations...", flush=True)
                s = serve_level(Path(args.config), side == "on", convs, c, cfg.model.name, Path(tmp), args)
                answers[side] = s.pop("answers")
                results["levels"][f"{side} c={c}"] = s
                print(f"caching {side} c={c}: TTFT p50 {fmt(s['ttft_p50_ms'])} ms, turn 4+ "
                      f"{fmt(s['ttft_p50_ms_by_turn']['4+'])} ms, {s['output_tokens_per_s']:.1f} tok/s, hit rate "
                      f"{fmt(s['hit_rate'], '.1%')}", flush=True)
            on, off = results["levels"][f"on c={c}"], results["levels"][f"off c={c}"]
            t_on, t_off = on["ttft_p50_ms_by_turn"]["4+"], off["ttft_p50_ms_by_turn"]["4+"]
            results["comparison"][f"c={c}"] = {
                "ttft_p50_turn4plus_ratio": t_on / t_off if t_on and t_off else None,
                "output_tokens_per_s_ratio": on["output_tokens_per_s"] / off["output_tokens_per_s"],
                "answers_differing": [list(k) for k in sorted(answers["on"])
                                      if answers["on"][k] != answers["off"].get(k)],
            }
    results["compute_path"] = results["levels"][f"on c={levels[0]}"]["health"]["compute_path"]
    table = report(args, results, levels)
    print(table)
    write_report(args.out, table, results)


if __name__ == "__main__":
    main()
