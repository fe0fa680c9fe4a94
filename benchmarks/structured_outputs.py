"""Structured outputs, served and in process: validity, spec == plain, their cost per token.

Against a running server (``rdserve up --config CONFIG``; ``--url``, default the config's port, or
``--serve`` to start and stop one here), chat requests that ask for one JSON object of an event
extraction schema shaped as in vLLM issue #15554 (required fields, several optional nullable fields
``{"type": ["string", "null"]}`` / ``["integer", "null"]``, one enum), each prompt a short text about
a person and an event (generated deterministically from ``--seed``, or ``--texts``: the first user
message of each row of a prompt JSONL), closed loop at ``--concurrency``, non-streaming:

(a) quality: the schema requests with ``rdserve.mode`` spec at temperature 0 and at 0.7 (seed =
    ``--seed`` + request index): every answer must parse and validate (``jsonschema``); greedy answers
    must equal the same requests decoded plain (mismatches are counted and kept in the JSON);
(b) tokens per step and output tokens/s with the schema and without it (the same prompts answered in
    free text, spec, temperature 0, the same ``max_tokens``);
(c) logprobs: the free-text requests again with ``logprobs: true, top_logprobs: 5`` (output tokens/s;
    the text must equal (b)'s and carry one entry of 5 alternatives per completion token);
(d) in process, the grammar mask cost: ``RequestGrammar.allowed()`` per token along real answers
    ((a)'s greedy ones, re-tokenized; with ``--skip-served``, the expected answers of the generated
    texts), and ``tree_allowed`` on draft trees of ``--num-beams`` x ``--draft-len`` tokens
    (``build_prefix_tree``; beam 0 the answer's next tokens, the others share a shorter prefix of it
    and then follow other answers), per tree and per tree row (node), on the default model's tokenizer.

Output tokens/s is completion tokens (the server's ``usage``) over the wall time of a run; tokens per
step is ``(accepted draft tokens + steps) / steps`` over the run's requests. Prints Markdown tables
naming the CPU and the compute path (``/health``'s ``compute_path``), writes JSON with the command line.

Usage:
    .venv/bin/rdserve up --config configs/local.yaml &    # or pass --serve
    python benchmarks/structured_outputs.py --config configs/local.yaml --num-requests 200 --concurrency 4 \\
        --out benchmarks/results/structured_outputs
    python benchmarks/structured_outputs.py --num-requests 8 --out /tmp/structured_smoke   # a quick check
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import httpx
import jsonschema
from bench_report import write_report

from cluster.config import load_config
from workers.kernels.build import cpu_model

CATEGORIES = ["meeting", "trip", "purchase", "celebration", "other"]
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "category": {"enum": CATEGORIES},
        "person": {"type": ["string", "null"]},
        "age": {"type": ["integer", "null"]},
        "date": {"type": ["string", "null"]},
        "location": {"type": ["string", "null"]},
        "attendees": {"type": ["integer", "null"]},
    },
    "required": ["title", "category"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "event", "schema": SCHEMA, "strict": True}}
INSTRUCTION = ("Extract the event from the text as a JSON object with the keys title, category (one of "
               f"{', '.join(CATEGORIES)}), person, age, date, location and attendees; use null for what the "
               "text does not say.\n\nText: ")
PERSONS = ["Maria Lopez", "Tom Becker", "Aiko Tanaka", "Samuel Okafor", "Priya Nair", "Lena Schmidt",
           "Omar Haddad", "Chen Wei", "Fatima Zahra", "Lucas Martin", "Sofia Rossi", "Jonas Berg"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Berlin", "Lima", "Cairo", "Oslo", "Denver", "Hanoi"]
DATES = ["March 3", "June 21", "next Friday", "October 10", "2024-05-17", "December 1", "tomorrow", "July 4"]
# (category, title, sentence): {p} person, {a} age, {c} city, {d} date, {n} attendees; a fact not in
# the sentence is null in the expected answer
TEMPLATES = [
    ("meeting", "budget review", "{p} ({a}) is organizing the budget review in {c} on {d} for {n} colleagues."),
    ("meeting", "project kickoff", "The project kickoff led by {p} takes place on {d}; {n} people signed up."),
    ("trip", "hiking trip", "{p} will go on a hiking trip near {c} {d}."),
    ("trip", "family visit", "Next month {p}, who is {a}, flies to {c} to visit her parents."),
    ("purchase", "used bicycle", "On {d}, {p} bought a used bicycle at a market in {c}."),
    ("purchase", "new laptop", "{p} finally ordered a new laptop."),
    ("celebration", "birthday party", "{p} turned {a} and celebrated in {c} with {n} friends on {d}."),
    ("celebration", "wedding", "The wedding of {p} in {c} had {n} guests."),
    ("other", "lost keys", "{p} lost the keys to the office somewhere in {c}."),
    ("other", "marathon", "{p}, aged {a}, ran the {c} marathon on {d} with {n} other runners."),
]


def event_texts(n: int, seed: int) -> list[tuple[str, dict]]:
    """``n`` (text, expected answer) pairs, the same for the same ``seed``; the answer is in the
    schema's key order (xgrammar generates properties in that order)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        category, title, sentence = rng.choice(TEMPLATES)
        facts = {"p": rng.choice(PERSONS), "a": rng.randint(18, 80), "c": rng.choice(CITIES), "d": rng.choice(DATES),
                 "n": rng.randint(2, 120)}
        expected = {"title": title, "category": category}
        for key, fact in (("person", "p"), ("age", "a"), ("date", "d"), ("location", "c"), ("attendees", "n")):
            expected[key] = facts[fact] if "{" + fact + "}" in sentence else None
        out.append((sentence.format(**facts), expected))
    return out


def file_texts(path: str, n: int, chars: int) -> list[str]:
    """The first user message of each row of prompt JSONL ``path`` (``messages`` or ``prompt``), cut
    to ``chars`` characters, cycled to ``n`` texts."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    texts = [" ".join((next((m["content"] for m in r["messages"] if m["role"] == "user"), "")
                       if "messages" in r else r["prompt"]).split())[:chars] for r in rows]
    texts = [t for t in texts if t]
    return [texts[i % len(texts)] for i in range(n)]


def run(client: httpx.Client, bodies: list[dict], concurrency: int) -> dict:
    """POST every body to /v1/chat/completions, ``concurrency`` at a time; per request the answer,
    finish reason, completion tokens, steps, accepted draft tokens, logprobs and latency; the run's
    wall time, output tokens/s and tokens per step.

    Raises:
        RuntimeError: a request was answered with an HTTP error (status and body in the message).
    """
    def one(body: dict) -> dict:
        t0 = time.perf_counter()
        resp = client.post("/v1/chat/completions", json=body)
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:500]}")
        data = resp.json()
        choice, stats = data["choices"][0], data["rdserve"]
        return {"content": choice["message"]["content"], "finish_reason": choice["finish_reason"],
                "completion_tokens": data["usage"]["completion_tokens"], "mode": stats["mode"],
                "num_steps": stats["num_steps"], "accepted_draft_tokens": stats["accepted_draft_tokens"],
                "logprobs": (choice.get("logprobs") or {}).get("content"), "latency_s": time.perf_counter() - t0}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, bodies))
    wall = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in results)
    steps = sum(r["num_steps"] for r in results)
    accepted = sum(r["accepted_draft_tokens"] for r in results)
    return {"results": results, "wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "tokens_per_step": (accepted + steps) / steps if steps else None,
            "finish_reasons": {f: sum(r["finish_reason"] == f for r in results)
                               for f in sorted({r["finish_reason"] for r in results})}}


def validate(results: list[dict]) -> dict:
    """Counts of answers that parse as JSON and that validate against ``SCHEMA``; the first few failures."""
    validator = jsonschema.Draft202012Validator(SCHEMA)
    parsed = valid = 0
    failures = []
    for i, r in enumerate(results):
        try:
            value = json.loads(r["content"])
        except json.JSONDecodeError as e:
            failures.append({"request": i, "error": f"parse: {e}", "finish_reason": r["finish_reason"],
                             "content": r["content"]})
            continue
        parsed += 1
        errors = [e.message for e in validator.iter_errors(value)]
        if errors:
            failures.append({"request": i, "error": "; ".join(errors), "content": r["content"]})
        else:
            valid += 1
    return {"parsed": parsed, "valid": valid, "failures": failures[:10]}


def mismatches(a: list[dict], b: list[dict]) -> list[dict]:
    """Requests whose answers differ between two runs of the same bodies, with both answers."""
    return [{"request": i, "a": x["content"], "b": y["content"]} for i, (x, y) in enumerate(zip(a, b))
            if x["content"] != y["content"]]


def served(args, cfg, texts: list[str]) -> dict:
    """Parts (a)-(c) against the server at ``args.url``."""
    model = cfg.model.name

    def body(text: str, i: int, *, schema: bool, temperature: float, mode: str, logprobs: bool = False) -> dict:
        b = {"model": model, "messages": [{"role": "user", "content": INSTRUCTION + text}],
             "max_tokens": args.max_tokens, "temperature": temperature, "rdserve": {"mode": mode}}
        if temperature > 0:
            b["seed"] = args.seed + i
        if schema:
            b["response_format"] = RESPONSE_FORMAT
        if logprobs:
            b.update(logprobs=True, top_logprobs=5)
        return b

    def bodies(**kw) -> list[dict]:
        return [body(t, i, **kw) for i, t in enumerate(texts)]

    out: dict = {}
    with httpx.Client(base_url=args.url, timeout=args.timeout) as client:
        health = client.get("/health").json()
        out["compute_path"] = health.get("compute_path")
        warm = [{**body(texts[0], 0, schema=s, temperature=0.0, mode=m), "max_tokens": 8}
                for s in (True, False) for m in ("spec", "plain")]
        run(client, warm, 1)  # compiles the schema (cached by spec) and warms both modes
        t = args.temperature
        runs = {
            "schema, T=0, spec": bodies(schema=True, temperature=0.0, mode="spec"),
            "schema, T=0, plain": bodies(schema=True, temperature=0.0, mode="plain"),
            f"schema, T={t} seeded, spec": bodies(schema=True, temperature=t, mode="spec"),
            "free text, T=0, spec": bodies(schema=False, temperature=0.0, mode="spec"),
            "free text + logprobs (top 5), T=0, spec": bodies(schema=False, temperature=0.0, mode="spec",
                                                              logprobs=True),
        }
        for name, bs in runs.items():
            print(f"{name}: {len(bs)} requests at concurrency {args.concurrency}...", flush=True)
            out[name] = run(client, bs, args.concurrency)
            if name.startswith("schema"):
                out[name]["validation"] = validate(out[name]["results"])
    names = list(runs)
    lp = out[names[4]]["results"]
    out["checks"] = {
        "greedy spec != plain (schema)": mismatches(out[names[0]]["results"], out[names[1]]["results"]),
        "logprobs changed the text": mismatches(out[names[3]]["results"], lp),
        "logprobs entries missing or not 5 alternatives": [
            i for i, r in enumerate(lp) if not r["logprobs"] or len(r["logprobs"]) != r["completion_tokens"]
            or any(len(e["top_logprobs"]) != 5 for e in r["logprobs"])],
    }
    for r in lp:  # checked above; the entries themselves (~100 KiB per request) stay out of the JSON
        r["logprobs"] = len(r["logprobs"] or [])
    return out


def mask_costs(args, answers: list[str]) -> dict:
    """Part (d): microseconds of ``allowed()`` per token and of ``tree_allowed`` per tree and per row,
    along ``answers`` (re-tokenized, then EOS); answers the grammar rejects are counted and skipped."""
    import torch
    import xgrammar

    from workers.models.pull import default_model_dir
    from workers.models.tokenizer import load_tokenizer
    from workers.redrafter.tree import build_prefix_tree
    from workers.structured.compiler import GrammarCompiler
    from workers.structured.errors import GrammarError
    from workers.structured.matcher import RequestGrammar
    from workers.structured.spec import GrammarSpec

    torch.set_num_threads(1)
    model_dir = default_model_dir()
    tokenizer = load_tokenizer(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    eos = config["eos_token_id"]
    stop_ids = sorted({tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])})
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, config["vocab_size"], stop_token_ids=stop_ids)
    setup_ms = 1e3 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    compiled = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    compile_ms = 1e3 * (time.perf_counter() - t0)

    sequences, rejected = [], 0
    for text in answers:
        ids = tokenizer.encode(text, add_special_tokens=False) + [stop_ids[0]]
        try:
            RequestGrammar(compiled).advance(ids)
            sequences.append(ids)
        except GrammarError:
            rejected += 1
    fill, per_token, per_tree, per_row, rows = [], [], [], [], []
    L, B = args.draft_len, args.num_beams
    bitmask = xgrammar.allocate_token_bitmask(1, compiled.vocab_size)
    for k, ids in enumerate(sequences):
        matcher = xgrammar.GrammarMatcher(compiled.grammar)  # the library's fill alone, without unpacking
        for token in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            fill.append(1e6 * (time.perf_counter() - t0))
            matcher.accept_token(token)
        grammar = RequestGrammar(compiled)
        for token in ids:
            t0 = time.perf_counter()
            grammar.allowed()
            per_token.append(1e6 * (time.perf_counter() - t0))
            grammar.advance([token])
        grammar = RequestGrammar(compiled)
        for i in range(len(ids) - L):
            beams = []
            for b in range(B):
                other = sequences[(k + b) % len(sequences)] if b else ids
                shared = L if b == 0 else max(0, L // 2 - b + 1)
                tail = [other[(i + j) % len(other)] for j in range(shared, L)]
                beams.append([ids[i - 1] if i else stop_ids[0]] + ids[i:i + shared] + tail)
            tree = build_prefix_tree(beams)
            tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
            t0 = time.perf_counter()
            grammar.tree_allowed(tokens, parents)
            dt = 1e6 * (time.perf_counter() - t0)
            per_tree.append(dt)
            per_row.append(dt / len(tokens))
            rows.append(len(tokens))
            grammar.advance([ids[i]])

    def quantiles(xs: list[float]) -> dict:
        return {"median": statistics.median(xs), "p90": statistics.quantiles(xs, n=10)[-1], "max": max(xs),
                "count": len(xs)} if len(xs) > 1 else {}

    return {"tokenizer_setup_ms": setup_ms, "compile_ms": compile_ms, "answers": len(sequences),
            "answers_rejected": rejected, "tree": f"{B} beams x {L} tokens", "mean_tree_nodes": statistics.mean(rows),
            "fill_us_per_token": quantiles(fill), "allowed_us_per_token": quantiles(per_token),
            "tree_allowed_us_per_tree": quantiles(per_tree), "tree_allowed_us_per_row": quantiles(per_row)}


def report(args, results: dict) -> str:
    lines = [f"CPU: {results['cpu']}; compute path: {results.get('compute_path', '-')}; config {args.config}; "
             f"{args.num_requests} requests at concurrency {args.concurrency}, max_tokens {args.max_tokens}; "
             f"xgrammar {results['xgrammar']}", ""]
    runs = {k: v for k, v in results.items() if isinstance(v, dict) and "results" in v}
    if runs:
        lines += ["| run | output tokens/s | tokens/step | mean completion tokens | finish reasons | parsed | valid |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in runs.items():
            v = r.get("validation", {})
            lines.append(f"| {name} | {r['output_tokens_per_s']:.1f} | {r['tokens_per_step']:.2f} | "
                         f"{r['output_tokens'] / len(r['results']):.1f} | "
                         f"{', '.join(f'{k} {n}' for k, n in r['finish_reasons'].items())} | "
                         f"{v.get('parsed', '-')} | {v.get('valid', '-')} |")
        lines += ["", "| check | requests failing |", "|---|---|"]
        lines += [f"| {name} | {len(bad)} |" for name, bad in results["checks"].items()]
    if "mask" in results:
        m = results["mask"]
        lines += ["", f"Grammar mask cost, in process, one thread: {m['answers']} answers ({m['answers_rejected']} "
                  f"rejected by the grammar when re-tokenized), tokenizer set-up {m['tokenizer_setup_ms']:.0f} ms, "
                  f"schema compile {m['compile_ms']:.1f} ms; trees of {m['tree']} ({m['mean_tree_nodes']:.1f} nodes "
                  "on average, root included)", "",
                  "| us | median | p90 | max | samples |", "|---|---|---|---|---|"]
        for label, key in (("xgrammar mask fill per token", "fill_us_per_token"),
                           ("allowed() per token (fill + bool mask)", "allowed_us_per_token"),
                           ("tree_allowed per tree", "tree_allowed_us_per_tree"),
                           ("tree_allowed per row", "tree_allowed_us_per_row")):
            q = m[key]
            if q:
                lines.append(f"| {label} | {q['median']:.1f} | {q['p90']:.1f} | {q['max']:.1f} | {q['count']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml", help="rdserve config (model name, default --url)")
    ap.add_argument("--url", help="server base URL; default http://HOST:PORT of the config's serve section")
    ap.add_argument("--serve", action="store_true", help="start `rdserve up --config CONFIG` here, stop it at the end")
    ap.add_argument("--num-requests", type=int, default=200, help="requests per run")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight (closed loop)")
    ap.add_argument("--max-tokens", type=int, default=256, help="completion tokens per request (at most)")
    ap.add_argument("--temperature", type=float, default=0.7, help="temperature of the seeded sampled run")
    ap.add_argument("--seed", type=int, default=0, help="seeds the generated texts and the sampled requests")
    ap.add_argument("--texts", help="prompt JSONL whose first user messages are the texts (e.g. "
                    "../shared/datasets/broad/dev.jsonl); default: generated event sentences")
    ap.add_argument("--text-chars", type=int, default=400, help="--texts: characters kept per text")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--num-beams", type=int, default=4, help="(d): beams per draft tree")
    ap.add_argument("--draft-len", type=int, default=4, help="(d): draft tokens per beam")
    ap.add_argument("--skip-served", action="store_true", help="only (d), no server")
    ap.add_argument("--skip-mask", action="store_true", help="only (a)-(c), no in-process mask timing")
    ap.add_argument("--out", default="benchmarks/results/structured_outputs", help="output prefix (.md and .json)")
    args = ap.parse_args()
    cfg = load_config(args.config)
    args.url = args.url or f"http://{cfg.serve.host}:{cfg.serve.port}"
    generated = event_texts(args.num_requests, args.seed)
    texts = file_texts(args.texts, args.num_requests, args.text_chars) if args.texts else [t for t, _ in generated]
    results: dict = {"command": shlex.join(["python", *sys.argv]), "cpu": cpu_model(), "xgrammar": version("xgrammar"),
                     "args": vars(args), "schema": SCHEMA}
    answers = [json.dumps(e, ensure_ascii=False) for _, e in generated]
    if not args.skip_served:
        server = None
        if args.serve:
            from served_vs_engine import start_server

            server = start_server(args.config, args.url)
        try:
            results.update(served(args, cfg, texts))
        finally:
            if server is not None:
                from served_vs_engine import stop_server

                stop_server(server)
        answers = [r["content"] for r in results["schema, T=0, spec"]["results"]]
    if not args.skip_mask:
        print("grammar mask cost, in process...", flush=True)
        results["mask"] = mask_costs(args, answers)
    table = report(args, results)
    print(table)
    write_report(args.out, table, results)


if __name__ == "__main__":
    main()
