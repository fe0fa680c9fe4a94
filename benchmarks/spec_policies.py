"""Speculation policies over real HTTP: always-spec, always-plain, the calibrated table, the goodput model.

One Ray Serve instance, one application per policy (same model, drafter and engine settings; each
replica idles while another is measured), driven by the streaming load generator closed loop at each
concurrency level, policies interleaved level by level so machine drift hits them alike:

- ``spec``: every request drafts with the config's default shape at every batch size
  (``speculation.policy: fixed``, ``default_mode: spec``);
- ``plain``: no request drafts (``speculation.policy: off``, ``default_mode: plain``);
- ``table``: the table ``rdserve calibrate`` derived into ``--calibration`` (its ``table``) as
  ``speculation.policy: table`` with the matching ``speculation.spec_max_load``;
- ``auto``: ``speculation.policy: auto`` (the goodput model, ``workers.speculation.goodput``) with
  ``--calibration``.

Each policy is what it names on every compute path: ``speculation.by_compute_path`` is dropped.

Prompts: a mix of ``broad/dev.jsonl``, GSM8K and HumanEval (``--mix broad``), or summarization rows
of ``broad/dev.jsonl`` only (``--mix summarization``: low acceptance). Output tokens/s and goodput
(requests/s meeting every SLO, vLLM's definition) per level; the table also gives auto against the
best fixed policy at each level and over the whole ramp.

Usage:
    python benchmarks/spec_policies.py --config configs/local.yaml \
        --calibration configs/local.calibration.json --concurrency 1,2,4,8,16,32 \
        --max-tokens 64 --out benchmarks/results/spec_policies
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench_prompts import DATASETS, chat_prompts
from bench_report import write_report
from bench_serve import config_with_model, local_serve

from cluster.evaluation.loadgen import LoadSpec, run_load
from cluster.evaluation.metrics import Slo
from cluster.evaluation.prompts import PromptRow

POLICIES = ("spec", "plain", "table", "auto")


def policy_config(cfg, policy: str, calibration: Path):
    """The config for one policy (a copy; every path is already absolute)."""
    # each policy below is what it names, whatever the config keys by compute path
    update: dict = {"table": None, "calibration": None, "by_compute_path": None}
    if policy == "spec":
        update.update(policy="fixed", default_mode="spec")
    elif policy == "plain":
        update.update(policy="off", default_mode="plain")
    elif policy == "auto":
        update.update(policy="auto", calibration=calibration, default_mode="auto")
    elif policy == "table":  # the table rdserve calibrate derived from the same measurements
        from cluster.cli.calibrate import spec_max_load
        from workers.speculation.schedule import validate_schedule

        measured = json.loads(calibration.read_text())
        rows = measured["table"] if "table" in measured else measured["spec_schedule"]  # older files' key
        update.update(policy="table", table=validate_schedule(rows), default_mode="auto",
                      spec_max_load=spec_max_load(rows))
    spec = cfg.speculation
    data = spec.model_dump(exclude_unset=True) | update
    return cfg.model_copy(update={"speculation": type(spec).model_validate(data)})


def prompt_mix(mix: str, datasets: Path) -> list[PromptRow]:
    broad = chat_prompts(datasets / "broad" / "dev.jsonl")
    if mix == "summarization":
        return [r for r in broad if r.category == "summarization"]
    math = [PromptRow("math", messages=[{"role": "user", "content": json.loads(line)["question"]
                                         + "\nSolve step by step."}])
            for line in (datasets / "gsm8k" / "gsm8k_dev.jsonl").read_text().split("\n") if line.strip()]
    code = [PromptRow("code", messages=[{"role": "user", "content": "Complete this Python function:\n\n"
                                         + json.loads(line)["prompt"]}])
            for line in (datasets / "humaneval" / "humaneval_dev.jsonl").read_text().split("\n") if line.strip()]
    rows, i = [], 0
    while len(rows) < 96:  # two broad rows, then one math, one code
        rows += [broad[2 * i % len(broad)], broad[(2 * i + 1) % len(broad)], math[i % len(math)], code[i % len(code)]]
        i += 1
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml", help="base config (model, drafter, engine, table)")
    ap.add_argument("--calibration", default="configs/local.calibration.json",
                    help="`rdserve calibrate --out` JSON for the auto policy")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated subset of {POLICIES}")
    ap.add_argument("--mix", choices=("broad", "summarization"), default="broad", help="prompt mix (see above)")
    ap.add_argument("--datasets-dir", default=str(DATASETS), help="holds broad/, gsm8k/ and humaneval/")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32", help="closed-loop concurrency levels")
    ap.add_argument("--requests-per-client", type=int, default=3, help="requests per level = this x concurrency "
                    "(at least 8)")
    ap.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request (at most)")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput SLO: time to first token")
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput SLO: time per output token")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the levels; each pass rotates the policy "
                    "order; a cell pools every pass (tokens / time, goodput / time) and the JSON keeps each pass")
    ap.add_argument("--out", default="benchmarks/results/spec_policies", help="output path without suffix")
    args = ap.parse_args()

    from cluster.deploy.app import deploy

    cfg = config_with_model(args.config)
    policies = args.policies.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = prompt_mix(args.mix, Path(args.datasets_dir))
    slo = Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    results: dict = {p: {} for p in policies}
    with local_serve() as port:
        for p in policies:
            deploy(policy_config(cfg, p, Path(args.calibration).resolve()), name=p, route_prefix=f"/{p}")
        passes: dict = {p: {c: [] for c in levels} for p in policies}
        for r in range(args.rounds):
            for c in levels:
                for p in policies[r % len(policies):] + policies[:r % len(policies)]:  # rotated each pass
                    url = f"http://127.0.0.1:{port}/{p}"
                    run_load(url, rows[:2], LoadSpec(model=cfg.model.name, max_tokens=8, concurrency=1,
                                                     max_requests=2), progress=False)  # warm-up
                    spec = LoadSpec(model=cfg.model.name, max_tokens=args.max_tokens, concurrency=c,
                                    max_requests=max(8, args.requests_per_client * c), duration_s=3600, grace_s=120)
                    s = run_load(url, rows, spec, progress=False).summary(slo)
                    cell = {k: s[k] for k in ("completed", "failed", "duration_s", "output_tokens",
                                              "output_throughput", "goodput", "tokens_per_step", "modes")}
                    cell["ttft_p50_ms"], cell["tpot_p50_ms"] = s["ttft_ms"]["p50"], s["tpot_ms"]["p50"]
                    passes[p][c].append(cell)
                    print(f"round {r + 1}/{args.rounds} c={c} {p}: {s['output_throughput']:.1f} tok/s, goodput "
                          f"{s['goodput']:.2f} req/s, failed {s['failed']}", flush=True)
        for p in policies:
            for c in levels:
                cells = passes[p][c]
                time_s = sum(x["duration_s"] for x in cells)
                results[p][c] = {"output_throughput": sum(x["output_tokens"] for x in cells) / time_s,
                                 "goodput": sum(x["goodput"] * x["duration_s"] for x in cells) / time_s,
                                 "failed": sum(x["failed"] for x in cells), "passes": cells}

    table, ratios = report(results, passes, policies, levels, args, len(rows))
    print(table)
    write_report(args.out, table, {"args": vars(args), "results": results, "per_pass_ratios": ratios})


def per_pass_ratios(passes: dict, fixed: list[str], c: int) -> list[float]:
    """auto / the best fixed policy of the same pass at concurrency ``c``, one per pass: the cells
    of one pass ran minutes apart, so machine drift between passes cancels out of each ratio."""
    out = []
    for i, cell in enumerate(passes["auto"][c]):
        best = max(passes[p][c][i]["output_throughput"] for p in fixed)
        out.append(cell["output_throughput"] / best)
    return out


def report(results: dict, passes: dict, policies: list[str], levels: list[int], args, n_prompts: int) -> tuple[str, dict]:
    """The Markdown table (pooled tokens/s and goodput per policy and level; auto against the best
    fixed policy pooled, and per pass as median [min-max]) and the per-pass ratios by level."""
    fixed = [p for p in policies if p != "auto"]
    compare = "auto" in policies and bool(fixed)
    lines = [f"mix {args.mix}, {n_prompts} prompts, {args.rounds} pass(es) pooled, max_tokens {args.max_tokens}, SLO TTFT {args.slo_ttft_ms:.0f} ms "
             f"TPOT {args.slo_tpot_ms:.0f} ms; output tokens/s (goodput req/s)", "",
             "| concurrency | " + " | ".join(policies)
             + (" | auto / best fixed | per pass: median [min-max] |" if compare else " |"),
             "|---" * (len(policies) + 1 + 2 * compare) + "|"]
    ratios: dict = {}
    for c in levels:
        cells = [f"{results[p][c]['output_throughput']:.1f} ({results[p][c]['goodput']:.2f})" for p in policies]
        if compare:
            best = max(results[p][c]["output_throughput"] for p in fixed)
            r = ratios[c] = per_pass_ratios(passes, fixed, c)
            cells += [f"{results['auto'][c]['output_throughput'] / best:.2f}x",
                      f"{statistics.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]"]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    if compare:
        sums = {p: sum(results[p][c]["output_throughput"] for c in levels) for p in policies}
        best_single = max(fixed, key=lambda p: sums[p])
        per_pass = [sum(passes["auto"][c][i]["output_throughput"] for c in levels)
                    / sum(passes[best_single][c][i]["output_throughput"] for c in levels) for i in range(args.rounds)]
        ratios["summed"] = per_pass
        lines += ["", "summed over the ramp: " + ", ".join(f"{p} {sums[p]:.0f}" for p in policies)
                  + f"; auto / best single fixed ({best_single}) = {sums['auto'] / sums[best_single]:.2f}x pooled, "
                  + f"per pass {', '.join(f'{x:.2f}x' for x in per_pass)}"]
    return "\n".join(lines), ratios


if __name__ == "__main__":
    main()
