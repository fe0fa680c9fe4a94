"""The evaluation report: ``results.json`` (every figure), ``report.md`` (for a person), PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.evaluation.plots import plot_acceptance, plot_load
from cluster.evaluation.staged_load import speculation_snippet

DEFINITIONS = """\
Metric definitions (as vLLM `bench serve`): **TTFT** = request sent -> first chunk with content;
**TPOT** = (E2E latency - TTFT) / (output tokens - 1) per request (one-token outputs left out);
**ITL** = gaps between consecutive content chunks, pooled over requests (a speculative step sends
its accepted tokens in one chunk, so ITL is per chunk); **E2E** = request sent -> end of stream;
**throughput** = completed requests (or their output tokens) / run duration; **goodput** = completed
requests meeting every SLO / run duration. Output tokens are the streamed text re-tokenized with the
model's tokenizer. **Tokens per step** = (accepted draft tokens + generation steps) / generation steps;
**acceptance rate at position k** = share of speculative steps whose accepted prefix reaches draft
position k; **drafted per accepted** = num_beams x draft length summed over steps / accepted draft tokens.
"""


def _ms(d: dict, key: str = "p50") -> str:
    return "-" if d.get(key) is None else f"{d[key]:.1f}"


def _num(v, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _summary_rows(rows: list[tuple[str, dict]]) -> list[str]:
    out = ["| run | ok/failed | req/s | output tok/s | goodput req/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms "
           "| ITL p50/p99 ms | E2E p50/p99 ms | tokens/step |", "|---" * 10 + "|"]
    for label, s in rows:
        tri = lambda d: f"{_ms(d)}/{_ms(d, 'p90')}/{_ms(d, 'p99')}"  # noqa: E731
        out.append(f"| {label} | {s['completed']}/{s['failed']} | {s['request_throughput']:.2f} | "
                   f"{s['output_throughput']:.1f} | {_num(s['goodput'])} | {tri(s['ttft_ms'])} | {tri(s['tpot_ms'])} | "
                   f"{_ms(s['itl_ms'])}/{_ms(s['itl_ms'], 'p99')} | {_ms(s['e2e_latency_ms'])}/"
                   f"{_ms(s['e2e_latency_ms'], 'p99')} | {_num(s['tokens_per_step'])} |")
    return out


def _compatibility(c: dict) -> list[str]:
    if "error" in c:
        return [f"**Unsupported:** {c['error']}"]
    rd = c["redrafter"]
    path = (c.get("server") or {}).get("compute_path")  # the kernels the server runs (absent: no server asked)
    auto = (c.get("speculation") or {}).get("policy") == "auto"
    lines = [f"- backend `{c['backend']}` on `{c['device']}`"
             + (f", compute path `{path}` (the server's kernels and weight format)" if path else "")
             + f", dtype `{c['dtype']}`, tp_size {c['tp_size']}, context length {c['max_seq_len']}, "
             f"replicas {c['replicas']}",
             f"- ReDrafter: {rd['num_beams']} beams x {rd['draft_len_per_beam']} draft tokens per beam "
             + ("for requests that force speculation (under policy auto the goodput model picks each "
                "iteration's shape) " if auto else "")
             + f"(drafter `{rd['drafter']}`)",
             "- versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in c["versions"].items())]
    lines += [f"- {name.replace('_', ' ')}: {what}" for name, what in c["features"].items()]
    if c.get("server"):
        lines.append(f"- server health: `{json.dumps(c['server'])}`")
    return lines


def _acceptance(a: dict) -> list[str]:
    lines = ["| shape | category | tokens/step | acceptance rate by position | drafted per accepted |",
             "|---|---|---|---|---|"]
    for shape in a["shapes"]:
        for cat, f in sorted(shape["by_category"].items()):
            rates = ", ".join(_num(r) for r in f["acceptance_rate_by_position"])
            lines.append(f"| {shape['num_beams']}x{shape['draft_len_per_beam']} | {cat} | "
                         f"{_num(f['tokens_per_step'])} | {rates} | {_num(f['drafted_per_accepted'])} |")
    return lines + ["", "![acceptance](acceptance.png)"]


def _quality(q: dict) -> list[str]:
    g = q["greedy"]
    verdict = "PASS" if g["passed"] else "FAIL"
    rule = ("float32: no mismatch allowed" if g["dtype"] == "float32"
            else f"{g['dtype']}: mismatches allowed where the plain top-2 log-prob gap < {g['tolerance']} nats")
    lines = [f"- greedy, token by token: **{verdict}**, {len(g['mismatches'])} mismatching of {g['compared']} "
             f"prompts ({rule})"]
    for m in g["mismatches"]:
        lines.append(f"  - prompt {m['prompt_index']} ({m['category']}) at token {m['position']}: plain "
                     f"{m['plain_token']} vs spec {m['spec_token']}, gap {_num(m['gap'], '.4f')}: {m['prompt']!r}")
    if "logprobs" in g:  # results.json of an earlier version have none
        lp = g["logprobs"]
        lines.append(f"- greedy logprobs: largest difference {lp['max_abs_diff']:.3g} over {lp['compared_tokens']} "
                     f"tokens of identical outputs; {len(lp['prompts_differing'])} prompt(s) differ at all "
                     "(0 expected on float32 and GGUF int8 compute paths)")
    for name, c in q["task_checks"].items():
        lines.append(f"- task check `{name}`: plain {c['plain']}/{c['n']}, spec {c['spec']}/{c['n']}")
    lines.append(f"- finish_reason differs on {len(q['finish_reason_differs'])} prompt(s); stop strings leaked "
                 f"into {len(q['stop_string_leaks'])} output(s)")
    if "sampled" in q:
        s = q["sampled"]
        lines.append(f"- sampled (T=1, {s['samples_per_prompt']} per prompt): token-distribution TV distance spec vs "
                     f"plain {s['tv_spec_vs_plain']:.3f}, plain vs plain {s['tv_plain_vs_plain']:.3f}: "
                     f"{'within noise' if s['within_noise'] else 'BEYOND NOISE'}")
    return lines


def _staged(s: dict) -> list[str]:
    rows = [(f"{mode} c={level}", summ) for mode, summaries in s["closed_loop"].items()
            for level, summ in zip(s["levels"], summaries)]
    if s.get("open_loop"):
        rate = s["open_loop"]["rate"]
        rows += [(f"{mode} rate={rate:g}/s", summ) for mode, summ in s["open_loop"]["by_mode"].items()]
    lines = [f"SLOs: `{json.dumps(s['slo'])}`", "", *_summary_rows(rows), "", "![load](load.png)"]
    d = s.get("decision")
    if d:
        pays = ", ".join(f"c={k}: {'yes' if v else 'no'}" for k, v in d["pays_by_level"].items())
        lines += ["", "### Decision",
                  f"Speculation pays (throughput >= plain and median TPOT <= plain) at: {pays}. Crossover "
                  f"concurrency {d['crossover_concurrency']}; merge into the config's `speculation:` section (read under "
                  "policy fixed or table; under auto the goodput model decides per iteration):", "", "```yaml",
                  speculation_snippet(d["spec_max_load"]).rstrip(), "```"]
    return lines


def render_markdown(results: dict) -> str:
    """The report as Markdown from the results dict (sections for the steps that ran)."""
    meta = results.get("meta", {})
    lines = ["# rdserve speculative decoding evaluation", "",
             f"Endpoint `{meta.get('url')}`, model `{meta.get('model')}`, config `{meta.get('config')}`, "
             f"prompts `{meta.get('prompts')}`, {meta.get('created', '')}", "", DEFINITIONS]
    if "baseline" in results:
        b = results["baseline"]
        lines += ["## 1. Baseline (speculation off)", "", f"Settings: `{json.dumps(b['settings'])}`", "",
                  *_summary_rows([("plain", b["summary"])]), ""]
    if "compatibility" in results:
        lines += ["## 2. Compatibility", "", *_compatibility(results["compatibility"]), ""]
    if "acceptance" in results:
        lines += ["## 3. Acceptance (greedy, in-process engine)", "", *_acceptance(results["acceptance"]), ""]
    if "quality" in results:
        lines += ["## 4. Quality regression", "", *_quality(results["quality"]), ""]
    if "staged_load" in results:
        lines += ["## 5. Staged load: spec vs plain vs auto", "", *_staged(results["staged_load"]), ""]
    return "\n".join(lines) + "\n"


def write_report(results: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write ``results.json``, ``report.md`` and the plots the results allow; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "report.md"}
    paths["json"].write_text(json.dumps(results, indent=1, default=str))
    if results.get("acceptance", {}).get("shapes"):
        paths["acceptance_png"] = plot_acceptance(results["acceptance"], out / "acceptance.png")
    if results.get("staged_load", {}).get("closed_loop"):
        paths["load_png"] = plot_load(results["staged_load"], out / "load.png")
    if results.get("staged_load", {}).get("decision"):
        paths["speculation_yaml"] = out / "speculation.yaml"
        # rendered from spec_max_load: results.json files of earlier versions hold other snippet keys
        paths["speculation_yaml"].write_text(speculation_snippet(results["staged_load"]["decision"]["spec_max_load"]))
    paths["markdown"].write_text(render_markdown(results))
    return paths
