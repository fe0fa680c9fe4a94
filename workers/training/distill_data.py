"""Self-distillation data: the base model's own greedy responses and the hidden states that chose
each response token.

For response tokens ``y_0..y_{n-1}`` we keep ``g_i``: the base model's post-norm hidden state at
the position before ``y_i`` (the state whose LM-head argmax is ``y_i``). A drafter trained on
``(g_i, y_i) -> y_{i+1..i+K}`` sees exactly what it sees while serving: the context of the last
accepted token and the root token the base model chose.

Generation is batched (``batch_size`` rows decoded together with per-row lengths; a row that has
finished leaves the batch) and resumable:
prompts are taken in chunks of ``chunk_size`` in the given order, each chunk sorted by length and
batched; each finished batch is one ``shard-CCC-BBBBB.pt`` file. A shard on disk is kept only when
it holds exactly the prompts its batch has now: extending the prompt list keeps the full chunks
already generated and regenerates the batches the new prompts change, so every prompt is in exactly
one shard.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from workers.forward_batch import AttentionGroup, ForwardBatch, contiguous_batch
from workers.models.llama import LlamaForCausalLM


@torch.inference_mode()
def generate_batch(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int]
) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy responses for a batch of prompts.

    Returns, per prompt, ``(response_ids, hiddens)`` with ``hiddens: [len(response_ids), H] float16``.
    """
    B = len(prompts)
    max_len = max(len(p) for p in prompts) + max_new_tokens + 1
    cache = model.new_cache(B * max_len)  # row b: slots b * max_len + position
    lengths = [0] * B
    last_tok, hid = [], []
    for b, ids in enumerate(prompts):
        h = model(cache, contiguous_batch(torch.tensor(ids), 0, base_slot=b * max_len))[-1]
        lengths[b] = len(ids)
        hid.append(h)
        last_tok.append(int(model.logits(h).argmax()))
    outputs: list[list[int]] = [[t] for t in last_tok]
    hiddens: list[list[torch.Tensor]] = [[h.half()] for h in hid]
    done = [t in eos_ids for t in last_tok]
    row_base = torch.arange(B)[:, None] * max_len
    for _ in range(max_new_tokens - 1):
        # Finished rows leave the batch (their KV slots stay where they are), so a long answer does
        # not keep a full batch of finished rows computing until it ends.
        active = [b for b in range(B) if not done[b]]
        if not active:
            break
        idx = torch.tensor(active)
        length = torch.tensor([lengths[b] for b in active])
        kv_len = int(length.max()) + 1
        kv_slots = row_base[idx] + torch.arange(kv_len)[None, :]
        mask = (torch.arange(kv_len)[None, :] <= length[:, None])[:, None, None, :]
        inp = torch.tensor([outputs[b][-1] for b in active])
        n = len(active)
        batch = ForwardBatch(inp, length, row_base[idx, 0] + length, [AttentionGroup(0, n, 1, kv_slots, mask)])
        h = model(cache, batch)
        nxt = model.logits(h).argmax(-1).tolist()
        for r, b in enumerate(active):
            lengths[b] += 1
            outputs[b].append(nxt[r])
            hiddens[b].append(h[r].half())
            done[b] = nxt[r] in eos_ids
    return [(outputs[b], torch.stack(hiddens[b])) for b in range(B)]


def generate_dataset(
    model,
    prompts: list[dict],
    out_dir: Path,
    max_new_tokens: int,
    batch_size: int,
    eos_ids: set[int],
    chunk_size: int = 960,
    engine_refill_shards: int = 4,
) -> None:
    """Write shard files ``[{"prompt_ids", "response_ids", "hiddens", "category"}, ...]``; skips
    shards that already exist (resume).

    ``model``: a :class:`LlamaForCausalLM` (:func:`generate_batch`) or a serving
    :class:`workers.engine.Engine` (:func:`workers.training.engine_data.generate_batch_engine`, which
    stops at the engine's own EOS ids). An engine gets ``engine_refill_shards`` shards' prompts at a
    time (its in-flight batching keeps ``batch_size`` rows busy across them); those shards are written
    when the group ends (an interruption loses at most the group) and resumed one by one.

    Raises:
        ValueError: ``engine_refill_shards`` below 1.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for c, start in enumerate(range(0, len(prompts), chunk_size)):
        chunk = range(start, min(start + chunk_size, len(prompts)))
        order = sorted(chunk, key=lambda i: len(prompts[i]["prompt_ids"]))
        jobs += [(c, n, order[i : i + batch_size]) for n, i in enumerate(range(0, len(order), batch_size))]
    if engine_refill_shards < 1:
        raise ValueError(f"engine_refill_shards must be >= 1, got {engine_refill_shards}")
    todo = [(c, n, batch) for c, n, batch in jobs
            if not _holds(out_dir / f"shard-{c:03d}-{n:05d}.pt", [prompts[i]["prompt_ids"] for i in batch])]
    # The engine refills its batch from a queue: hand it several shards' prompts at once so rows
    # finishing early are replaced by the next shard's, instead of the batch draining to its longest.
    group = 1 if isinstance(model, LlamaForCausalLM) else engine_refill_shards
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="self-distillation data", unit="batch")
    for g in range(0, len(todo), group):
        jobs_now = todo[g : g + group]
        batch_ids = [prompts[i]["prompt_ids"] for _, _, batch in jobs_now for i in batch]
        if isinstance(model, LlamaForCausalLM):
            results = generate_batch(model, batch_ids, max_new_tokens, eos_ids)
        else:
            from workers.training.engine_data import generate_batch_engine

            results = generate_batch_engine(model, batch_ids, max_new_tokens)
        for c, n, batch in jobs_now:
            records = [
                {
                    "prompt_ids": prompts[i]["prompt_ids"],
                    "response_ids": resp,
                    "hiddens": hid,
                    "category": prompts[i].get("category", "unknown"),
                }
                for i, (resp, hid) in zip(batch, results[: len(batch)])
            ]
            results = results[len(batch):]
            shard = out_dir / f"shard-{c:03d}-{n:05d}.pt"
            tmp = shard.with_suffix(".tmp")
            torch.save(records, tmp)
            tmp.rename(shard)
            bar.update(1)
            bar.set_postfix(tokens=sum(len(r["response_ids"]) for r in records))
    bar.close()


def _holds(shard: Path, prompt_ids: list[list[int]]) -> bool:
    """Whether ``shard`` exists and holds exactly these prompts, in order (its tensors are mapped,
    not read)."""
    if not shard.exists():
        return False
    return [r["prompt_ids"] for r in torch.load(shard, weights_only=False, mmap=True)] == prompt_ids
