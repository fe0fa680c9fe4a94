"""Which draft tree pays on this machine: exact tokens per step of many tree policies, priced with
measured step costs (``cluster.evaluation.tree_sim``).

The engine decodes the prompts plainly and greedily once (batch 1, the serving path), keeping each
response token's hidden state; the drafter then proposes, from those hidden states, what it would
draft after every response token (distinct first tokens, each continued greedily: the engine's
``speculation.draft_search: distinct_first``), and the prompt-lookup beam is matched on the context as the engine
does (``workers.redrafter.prompt_lookup``, its length doubling after a beam accepted whole). Each
policy (beams x drafted tokens, lookup length) is replayed over the responses with exact greedy
acceptance, and priced with the step-time table of ``benchmarks/tree_costs.py`` (``--costs``): the
decode-phase speedup over plain decoding it would reach here, prefill excluded.

Usage:
    python benchmarks/tree_costs.py --config configs/local.yaml --out benchmarks/results/tree_costs
    python benchmarks/tree_policies.py --config configs/local.yaml --prompts ../shared/datasets/broad/dev.jsonl \\
        --prompts-per-category 8 --costs benchmarks/results/tree_costs.json --out benchmarks/results/tree_policies
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_report import write_report
from tqdm import tqdm

from cluster.config import load_config
from cluster.evaluation.tree_sim import Replay, RowCosts, replay
from cluster.replica.build import build_engine
from workers.redrafter.beam_search import draft_distinct_first_batch
from workers.redrafter.prompt_lookup import NgramIndex, PromptLookup
from workers.training.engine_data import generate_batch_engine
from workers.training.prompt_sources import first_per_category


@torch.inference_mode()
def drafter_chains(engine, hidden: torch.Tensor, tokens: list[int], width: int, depth: int) -> list[list[list[int]]]:
    """Per response position ``i``: the drafter's ``width`` most likely first tokens after token ``i``
    (context ``hidden[i]``), each continued greedily to ``depth`` tokens (the engine's
    :func:`~workers.redrafter.beam_search.draft_distinct_first_batch`): ``[i][beam] -> tokens``."""
    dtype = next((t.dtype for t in engine.drafter.parameters()), torch.float32)  # packed CPU layers: buffers only
    device = engine.executor.device
    beams = draft_distinct_first_batch(engine.drafter, engine.executor.embed, hidden.to(device, dtype),
                                       torch.tensor(tokens, device=device), width, depth)
    return beams[:, :, 1:].cpu().tolist()  # column 0 is the root


class TreePolicy:
    """``num_beams`` distinct first tokens x ``draft_len`` tokens, plus a prompt-lookup beam of
    ``lookup.num_tokens`` (None: none) whose length follows :meth:`PromptLookup.next_length`."""

    def __init__(self, chains, num_beams: int, draft_len: int, lookup: PromptLookup | None, prompt: list[int]):
        self.chains, self.num_beams, self.draft_len, self.lookup = chains, num_beams, draft_len, lookup
        self.index = NgramIndex(lookup.min_n, lookup.max_n) if lookup else None
        self.prompt_len = len(prompt)
        self.length = lookup.num_tokens if lookup else 0
        self.beam: list[int] = []

    def __call__(self, i: int, context, limit: int):
        beams = [c[: min(self.draft_len, limit)] for c in self.chains[i][: self.num_beams]]
        self.beam = []
        if self.index is not None:  # as ModelRunner._draft: the beam's length, cut to the budget
            self.index.sync(list(context[: self.prompt_len]), list(context[self.prompt_len:]))
            self.beam = self.index.propose(min(self.length, limit))
            if self.beam:
                beams.append(self.beam)
        return beams, self.draft_len

    def observe(self, accepted: list[int]) -> None:
        if self.beam:
            self.length = self.lookup.next_length(self.length, accepted[: len(self.beam)] == self.beam)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--prompts", required=True, help="JSONL prompts ('messages' or 'prompt', 'category'), e.g. "
                    "../shared/datasets/broad/dev.jsonl (never a training split)")
    ap.add_argument("--prompts-per-category", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--costs", required=True, help="JSON of benchmarks/tree_costs.py (measured on this machine)")
    ap.add_argument("--shapes", default="1x1,1x2,1x3,2x1,2x2", help="num_beams x draft_len_per_beam, comma-separated")
    ap.add_argument("--lookup", default="0,1,2,3,4,8,2:8,3:8", help="prompt-lookup beam lengths, comma-separated: N "
                    "(0: none) or N:M (N tokens, doubling up to M after a beam accepted whole: "
                    "speculation.prompt_lookup_max_num_tokens)")
    ap.add_argument("--out", default="benchmarks/results/tree_policies")
    args = ap.parse_args()

    try:
        shapes = list(dict.fromkeys(tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")))
        if any(len(s) != 2 or min(s) < 1 for s in shapes):
            raise ValueError(args.shapes)
    except ValueError:
        ap.error(f"--shapes takes B x D pairs such as 1x1,2x2 with B, D >= 1; got {args.shapes!r}")
    try:
        lookups = list(dict.fromkeys(tuple(int(x) for x in v.split(":")) for v in args.lookup.split(",")))
    except ValueError:
        ap.error(f"--lookup takes lengths N or N:M such as 0,4,2:8; got {args.lookup!r}")
    if args.max_tokens < 2:
        ap.error("--max-tokens must be at least 2 (a response of one token has no decode step)")
    if not Path(args.prompts).is_file():
        ap.error(f"--prompts {args.prompts}: no such file")
    cfg = load_config(args.config)
    spec = cfg.speculation
    policies_lookup = {}
    for k in lookups:
        if len(k) > 2 or k[0] < 0 or (k[0] == 0 and len(k) == 2):
            ap.error(f"--lookup takes N (0: none) or N:M with 1 <= N <= M; got {':'.join(map(str, k))}")
        try:
            grow = k[1] if len(k) == 2 else None
            policies_lookup[k] = PromptLookup(spec.prompt_lookup_min, spec.prompt_lookup_max, k[0], grow) if k[0] else None
        except ValueError as err:
            ap.error(f"--lookup {':'.join(map(str, k))}: {err}")
    try:
        cost_json = json.loads(Path(args.costs).read_text())
        costs = RowCosts(cost_json["plain_ms"], tuple(cost_json["tree_ms"]), cost_json.get("draft_position_ms", 0.0))
    except (OSError, ValueError, KeyError, TypeError) as err:
        ap.error(f"--costs {args.costs}: not a cost table of benchmarks/tree_costs.py ({err!r})")

    engine = build_engine(cfg)
    if engine.drafter is None:
        raise SystemExit(f"{args.config}: no drafter (drafter.path), nothing to replay")
    source = [json.loads(line) for line in Path(args.prompts).read_text().split("\n") if line.strip()]
    prompts = [p for ps in first_per_category(source, args.prompts_per_category).values() for p in ps]
    width, depth = max(s[0] for s in shapes), max(s[1] for s in shapes)
    records = []
    for p in tqdm(prompts, desc="greedy responses", unit="prompt"):
        ids = engine.encode_chat(p["messages"]) if "messages" in p else engine.encode_prompt(p["prompt"])
        tokens, hidden = generate_batch_engine(engine, [ids], args.max_tokens)[0]
        records.append((p.get("category", "unknown"), ids, tokens, drafter_chains(engine, hidden, tokens, width, depth)))

    results = {}
    for b, d in shapes:
        for (k, *grow), lookup in policies_lookup.items():
            total = Replay()
            for _, ids, tokens, chains in records:
                replay(ids, tokens, TreePolicy(chains, b, d, lookup, ids), costs, args.max_tokens, into=total)
            name = f"{b}x{d}, lookup {k}" + (f" growing to {grow[0]}" if grow else "")
            results[name] = {"tokens_per_step": total.tokens_per_step, "rows_per_step": total.rows_per_step,
                             "decode_speedup": total.decode_speedup}
    best = max(results, key=lambda n: results[n]["decode_speedup"])
    lines = [f"{len(records)} prompts of {args.prompts}, max_tokens {args.max_tokens}, greedy; costs {args.costs} "
             f"(plain {costs.plain_ms:.2f} ms, trees {', '.join(f'{t:.2f}' for t in costs.tree_ms)} ms from 2 rows, "
             f"+{costs.draft_position_ms:.2f} ms per further drafted position)", "",
             "| policy | tokens/step | rows/step | decode speedup (modelled) |", "|---|---|---|---|"]
    for name, r in results.items():
        mark = " **best**" if name == best else ""
        lines.append(f"| {name}{mark} | {r['tokens_per_step']:.3f} | {r['rows_per_step']:.2f} | {r['decode_speedup']:.3f}x |")
    table = "\n".join(lines)
    print(table)
    write_report(args.out, table, {"results": results, "best": best, "costs": cost_json, "prompts": args.prompts,
                                   "prompts_per_category": args.prompts_per_category, "max_tokens": args.max_tokens,
                                   "config": args.config})


if __name__ == "__main__":
    main()
