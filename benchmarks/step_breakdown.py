"""Where a decoding step's time goes, in process: linear layers, attention, RoPE and KV writes, norms,
LM head, ReDrafter drafting, prompt lookup, tree building, acceptance and sampling, the model's
Python glue (small torch ops, module calls) and the engine's scheduling and bookkeeping.

The engine decodes the prompts at batch 1, or ``--batch-size`` of them together (``--mode plain`` and/or ``spec``; spec at the config's
``num_beams`` x ``draft_len_per_beam`` or ``--num-beams``/``--draft-len-per-beam``, at every batch
size, whatever the config's ``speculation.policy`` says). Each part is timed by wrapping the function that does it
(``time.perf_counter`` on entry and exit; about a microsecond per call) and counted exclusively:
a wrapped call inside another wrapped part belongs to the inner part, except inside the drafter,
the LM head and prompt lookup, which own everything they call (their linears count as drafting, not
as linear layers). "engine: scheduling, bookkeeping" is ``Engine.step`` minus every other part,
"model: glue" the model's forward minus its parts. Steps that prefill a prompt are left out, so
the table describes decode steps (plain: one row per request; spec: one tree per request). By default the decoder stack runs
in one C call (``workers/kernels/decoder.c``), timed as one part; ``--unfused`` runs it layer by
layer from Python to split it into its parts.

Usage:
    python benchmarks/step_breakdown.py --config configs/local.yaml --prompts ../shared/datasets/broad/dev.jsonl \\
        --prompts-per-category 1 --max-tokens 96 --out benchmarks/results/step_breakdown
(prints a Markdown table per mode, writes JSON)
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from bench_report import write_report
from bench_spec import fixed_speculation

from cluster.config import load_config
from cluster.replica.build import build_engine
from workers import engine as engine_mod
from workers import model_runner
from workers.kernels import decode_attention, packed_linear, quant_linear
from workers.models import llama
from workers.models.tokenizer import apply_chat_template
from workers.sampling_params import SamplingParams
from workers.training.prompt_sources import first_per_category

OWNERS = {"drafting (ReDrafter beams)", "LM head", "prompt lookup"}  # own everything they call


class PartTimer:
    """Exclusive time per part over a stack of wrapped calls."""

    def __init__(self) -> None:
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self.stack: list[list] = []  # [part, start, time in wrapped children]
        self.enabled = False

    def wrap(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.enabled or (self.stack and self.stack[-1][0] in OWNERS):
                return fn(*args, **kwargs)
            frame = [part, time.perf_counter(), 0.0]
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - frame[1]
                self.stack.pop()
                self.total[part] += elapsed - frame[2]
                self.calls[part] += 1
                if self.stack:
                    self.stack[-1][2] += elapsed
        return timed


def patch(timer: PartTimer) -> None:
    """Wrap the functions that do each part, where their callers look them up."""
    def on(owner, name, part):
        timed = timer.wrap(part, getattr(owner, name))
        is_static = isinstance(getattr(owner, "__dict__", {}).get(name), staticmethod)
        setattr(owner, name, staticmethod(timed) if is_static else timed)

    on(engine_mod.Engine, "step", "engine: scheduling, bookkeeping")
    on(llama.LlamaModel, "forward", "model: glue (small ops, module calls)")
    on(quant_linear.QuantLinear, "forward", "linear layers")
    on(packed_linear.PackedLinear, "forward", "linear layers")
    on(decode_attention, "attend", "attention")
    on(decode_attention, "rope_write_kv", "RoPE + KV write")
    on(llama, "rms_norm", "RMS norms")
    on(llama, "silu_mul", "SwiGLU silu * up")
    on(llama, "decoder_forward", "decoder stack in one C call")
    on(llama.LlamaForCausalLM, "logits", "LM head")
    on(model_runner, "draft_beams_batch", "drafting (ReDrafter beams)")
    on(model_runner, "draft_distinct_first_batch", "drafting (ReDrafter beams)")
    on(model_runner, "draft_distinct_first_fused", "drafting (ReDrafter beams)")
    on(model_runner.ModelRunner, "_lookup_beam", "prompt lookup")
    on(model_runner, "build_prefix_tree", "tree building")
    on(model_runner, "accept_greedy", "acceptance, sampling")
    on(model_runner.ModelRunner, "_choose", "acceptance, sampling")
    on(model_runner, "greedy_tokens", "acceptance, sampling")  # the batched argmax of greedy requests


def decode(engine, batch: list[list[int]], mode: str, max_tokens: int, ignore_eos: bool,
           timer: PartTimer) -> tuple[int, int, float]:
    """Decode the prompts of ``batch`` together (submitted at once, each to ``max_tokens``, or its EOS
    unless ``ignore_eos``); returns (decode steps, tokens they produced, their wall seconds). Only
    steps that decode every request of the batch (after each one's first token, before any has
    finished) are timed: no prefill in them, and a batch-N step always has N requests."""
    names = [f"bd{i}" for i in range(len(batch))]
    for name, ids in zip(names, batch):
        engine.add_request(name, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), mode)
    steps = tokens = 0
    wall = 0.0
    started, finished = set(), set()
    while len(finished) < len(names):
        timing = len(started) == len(names) and not finished
        timer.enabled = timing
        t0 = time.perf_counter()
        deltas = [d for d in engine.step() if d.request_id in names]
        if timing:
            wall += time.perf_counter() - t0
            steps += 1
            tokens += sum(len(d.token_ids) for d in deltas)
        started.update(d.request_id for d in deltas if d.token_ids)
        finished.update(d.request_id for d in deltas if d.finished)
    timer.enabled = False
    return steps, tokens, wall


def batches_of(ids: list[list[int]], size: int) -> list[list[list[int]]]:
    """The prompts in batches of ``size``, in order; the last batch is filled with the first prompts
    again (so every prompt is decoded, and a batch-N step always has N requests)."""
    count = -(-len(ids) // size)
    return [[ids[(i * size + j) % len(ids)] for j in range(size)] for i in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--prompts", required=True, help="JSONL prompts ('messages' or 'prompt', optional 'category')")
    ap.add_argument("--prompts-per-category", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--modes", default="plain,spec", help="comma-separated: plain, spec")
    ap.add_argument("--num-beams", type=int)
    ap.add_argument("--draft-len-per-beam", type=int)
    ap.add_argument("--unfused", action="store_true", help="run the decoder layer by layer from Python "
                    "(LlamaModel.fused_decoder = False) to see each part; default: the whole stack in one C call")
    ap.add_argument("--batch-size", type=int, default=1,
                    help="requests decoded together (the prompts in order; the last batch is filled with the first "
                         "prompts again; the prefix cache is off, so a repeated prompt is computed again)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="decode every request to --max-tokens (compare batch sizes on the same tokens)")
    ap.add_argument("--out", default="benchmarks/results/step_breakdown")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"plain", "spec"}:
        ap.error(f"--modes takes plain and/or spec, got {args.modes!r}")

    cfg = load_config(args.config)
    if not 1 <= args.batch_size <= cfg.engine.max_batch_size:
        ap.error(f"--batch-size must be 1 .. engine.max_batch_size ({cfg.engine.max_batch_size}), got {args.batch_size}")
    if args.max_tokens < 2 or args.prompts_per_category < 1:
        ap.error("--max-tokens must be at least 2 (the first token comes with the prefill; only later steps are "
                 "timed) and --prompts-per-category at least 1")
    # the prefix cache off: a prompt decoded again (a batch filled with repeats, the next mode) computes its
    # prompt and reads its own KV blocks, as a new request would
    cfg.engine = cfg.engine.model_copy(update={"enable_prefix_caching": False})
    spec = cfg.speculation
    shape = (args.num_beams or spec.num_beams, args.draft_len_per_beam or spec.draft_len_per_beam)
    # policy fixed: the shape at every batch size up to engine.max_batch_size
    cfg.speculation = spec = fixed_speculation(spec, num_beams=shape[0], draft_len_per_beam=shape[1])
    timer = PartTimer()
    patch(timer)
    engine = build_engine(cfg)
    engine.model.model.fused_decoder = not args.unfused
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = [p for ps in first_per_category(rows, args.prompts_per_category).values() for p in ps]
    ids = [apply_chat_template(engine.tokenizer, p["messages"]) if "messages" in p
           else engine.tokenizer(p["prompt"])["input_ids"] for p in prompts]
    if not ids:
        ap.error(f"no prompts in {args.prompts}")
    batches = batches_of(ids, args.batch_size)
    decode(engine, [ids[0]] * args.batch_size, "plain", 8, True, timer)  # warm-up
    timer.total.clear()
    timer.calls.clear()

    results, tables = {}, []
    for mode in modes:
        timer.total.clear()
        timer.calls.clear()
        steps = tokens = 0
        wall = 0.0
        for batch in batches:
            s, t, w = decode(engine, batch, mode, args.max_tokens, args.ignore_eos, timer)
            steps, tokens, wall = steps + s, tokens + t, wall + w
        if not steps:
            raise SystemExit(f"{mode}: no decode step was timed (every request ended within its first steps); "
                             "raise --max-tokens or pass --ignore-eos")
        parts = {k: v / steps * 1e3 for k, v in sorted(timer.total.items(), key=lambda kv: -kv[1])}
        results[mode] = {"steps": steps, "tokens": tokens, "wall_s": wall, "ms_per_step": wall / steps * 1e3,
                         "tokens_per_step": tokens / steps, "tokens_per_s": tokens / wall, "parts_ms_per_step": parts,
                         "calls_per_step": {k: timer.calls[k] / steps for k in parts}}
        lines = [f"{mode}: {steps} decode steps, {tokens / steps:.2f} tokens/step, {wall / steps * 1e3:.2f} ms/step "
                 f"({tokens / wall:.1f} tokens/s)", "", "| part | ms/step | share | calls/step |", "|---|---|---|---|"]
        for k, v in parts.items():
            lines.append(f"| {k} | {v:.2f} | {v / (wall / steps * 1e3):.0%} | {timer.calls[k] / steps:.0f} |")
        tables.append("\n".join(lines))
    policy = engine.thread_policy  # engine.adaptive_threads: each step on the thread count its times favour
    threads = policy.max_threads if policy is not None else torch.get_num_threads()
    threads_text = f"up to {threads} (adaptive)" if policy is not None else str(threads)
    header = (f"{'layer by layer (Python)' if args.unfused else 'fused decoder (one C call)'}; compute path {engine.compute_path}, threads {threads_text}, {len(ids)} prompts, batch size {args.batch_size} ({len(batches)} batches, {len(batches) * args.batch_size - len(ids)} repeated prompts), max_tokens "
              f"{args.max_tokens}{' (EOS ignored)' if args.ignore_eos else ''}, spec shape {shape[0]}x{shape[1]}, prompt lookup {spec.prompt_lookup_num_tokens}")
    table = header + "\n\n" + "\n\n".join(tables)
    print(table)
    write_report(args.out, table, {"config": args.config, "compute_path": engine.compute_path, "threads": threads, "adaptive_threads": policy is not None,
                                   "fused_decoder": not args.unfused, "prompts": len(ids), "batch_size": args.batch_size, "batches": len(batches),
                                   "repeated_prompts": len(batches) * args.batch_size - len(ids), "ignore_eos": args.ignore_eos,
                                   "prefix_caching": False, "max_tokens": args.max_tokens, "shape": list(shape),
                                   "modes": results})


if __name__ == "__main__":
    main()
