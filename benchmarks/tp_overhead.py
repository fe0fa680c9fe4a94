"""MPI control overhead of tensor parallelism per iteration: TP1 vs TP2 on a tiny model.

On a tiny random-weight Llama (default 2 layers, hidden 64) the compute is negligible, so the time
a TP2 iteration adds over TP1 is what tensor parallelism costs in control and collectives: one
command broadcast per executor call, ``1 + 2 * layers`` all-reduces per forward (embedding, o_proj
and down_proj of each layer) and one gather per logits call. Measured iterations:

* ``decode``: forward of 1 token after ``--context`` cached tokens, then logits of that row;
* ``tree``: forward of a 2x2 draft tree (5 nodes, tree attention), logits of all 5 rows, and the
  KV compaction of a 2-node accepted path (``copy_slots``).

Figures are medians over ``--iters`` iterations per executor and kind, taken in ``--rounds``
interleaved rounds. Rows: ``local`` (:class:`~workers.executor.LocalExecutor`, no MPI), ``tp1`` (TPExecutor with one
rank: the executor's wire packing without collectives), ``tp2`` (two MPI ranks, spawned).

Usage: python benchmarks/tp_overhead.py [--iters 1000] [--rounds 10] [--context 64] [--layers 2] [--hidden 64]
Prints a Markdown table and writes benchmarks/results/tp_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from workers.executor import LocalExecutor
from workers.forward_batch import contiguous_batch
from workers.models.loader import load_model
from workers.redrafter.tree import build_prefix_tree
from workers.tp.executor import TPExecutor

VOCAB = 400


def make_model_dir(path: Path, layers: int, hidden: int, heads: int, kv_heads: int) -> Path:
    """A random-weight Hugging Face Llama (weights only; no tokenizer is needed here)."""
    cfg = HFLlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                        max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    HFLlama(cfg).float().save_pretrained(path, safe_serialization=True)
    return path


def iterations(ex, context: int):
    """``{name: callable}`` of the measured iterations, after filling ``context`` slots."""
    ex.forward(contiguous_batch(torch.randint(3, VOCAB, (context,)), 0))
    tok = torch.tensor([5])
    tree = build_prefix_tree(torch.tensor([[5, 11, 12], [5, 13, 14]]))
    tree_batch = contiguous_batch(tree.tokens, context, tree.mask, context + tree.depths)
    src, dst = torch.tensor([context + 2, context + 4]), torch.tensor([context + 1, context + 2])

    def decode():
        h = ex.forward(contiguous_batch(tok, context))
        ex.logits(h)

    def verify_tree():
        h = ex.forward(tree_batch)
        ex.logits(h)
        ex.copy_slots(src, dst)

    return {"decode": decode, "tree": verify_tree}


def time_ms(fn, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=1000, help="timed iterations per executor and kind")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds the iterations are split into")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/tp_overhead.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "m", args.layers, args.hidden, args.heads, args.kv_heads)
        slots = args.context + 16
        executors = {"local": LocalExecutor(load_model(model_dir), slots),
                     "tp1": TPExecutor(str(model_dir), 1, slots, num_threads=1),
                     "tp2": TPExecutor(str(model_dir), 2, slots, num_threads=1)}
        try:
            fns = {name: iterations(ex, args.context) for name, ex in executors.items()}
            samples = {name: {kind: [] for kind in f} for name, f in fns.items()}
            for fn in (f for per in fns.values() for f in per.values()):
                time_ms(fn, 20)  # warm-up
            for _ in range(args.rounds):  # interleaved, so drifting background load hits all alike
                for name, per in fns.items():
                    for kind, fn in per.items():
                        samples[name][kind] += time_ms(fn, args.iters // args.rounds)
        finally:
            for ex in executors.values():
                ex.close()
    results = {name: {kind: statistics.median(t) for kind, t in per.items()} for name, per in samples.items()}
    rows = ["| executor | decode ms/iteration | tree ms/iteration |", "|---|---|---|"]
    for name, r in results.items():
        rows.append(f"| {name} | {r['decode']:.3f} | {r['tree']:.3f} |")
    over = {k: results["tp2"][k] - results["local"][k] for k in ("decode", "tree")}
    rows.append(f"| tp2 - local | {over['decode']:+.3f} | {over['tree']:+.3f} |")
    load_after = os.getloadavg()
    rows.append(f"\n1-minute load average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
                f"({os.cpu_count()} CPUs): other processes' load changes these figures")
    print("\n".join(rows))
    out = {
        "args": vars(args), "median_ms": results, "tp2_minus_local_ms": over,
        "collectives_per_iteration": {
            "decode": {"broadcasts": 2, "all_reduces": 1 + 2 * args.layers, "gathers": 1},
            "tree": {"broadcasts": 3, "all_reduces": 1 + 2 * args.layers, "gathers": 1},
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "loadavg_before": load_before, "loadavg_after": load_after},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
