"""Self-distillation generation with rows that finish at different steps: every row's response
and hidden states are the ones the model gives that prompt alone."""

from __future__ import annotations

import random

import torch

from workers.models.loader import load_model
from workers.training.distill_data import generate_batch, generate_dataset


def test_batched_responses_with_early_finishers_equal_solo_responses(tiny_model_dirs):
    base = load_model(tiny_model_dirs["tied_gqa2"])
    rng = random.Random(3)
    prompts = [[rng.randrange(3, base.config.vocab_size) for _ in range(rng.randint(2, 14))] for _ in range(10)]
    # an end token that the free-running responses produce at different steps, so rows finish apart
    free = generate_batch(base, prompts, 20, set())
    counts: dict[int, int] = {}
    for resp, _ in free:
        for t in set(resp[1:12]):
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=lambda t: (counts[t] < len(prompts), counts[t]))
    batched = generate_batch(base, prompts, 20, {eos})
    lengths = {len(r) for r, _ in batched}
    assert len(lengths) > 2 and max(lengths) == 20, lengths  # some rows stop early, some run to the cap
    for ids, (resp, hid) in zip(prompts, batched):
        solo_resp, solo_hid = generate_batch(base, [ids], 20, {eos})[0]
        assert resp == solo_resp
        assert hid.shape == (len(resp), base.config.hidden_size) and hid.dtype == torch.float16
        torch.testing.assert_close(hid.float(), solo_hid.float(), atol=2e-3, rtol=2e-3)


def test_a_longer_prompt_list_on_a_re_run_puts_every_prompt_in_one_shard(tiny_model_dirs, tmp_path):
    """Batches are sorted by length within a chunk, so new prompts change the last chunk's batches:
    stale shards are regenerated, and no prompt is lost or doubled."""
    base = load_model(tiny_model_dirs["tied_gqa2"])
    rng = random.Random(4)
    rows = [{"prompt_ids": [rng.randrange(3, base.config.vocab_size) for _ in range(rng.randint(2, 14))]}
            for _ in range(10)]

    def records():
        return [r for p in sorted(tmp_path.glob("shard-*.pt")) for r in torch.load(p, weights_only=False)]

    generate_dataset(base, rows[:6], tmp_path, 4, batch_size=3, eos_ids=set(), chunk_size=8)
    first = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("shard-*.pt")}
    generate_dataset(base, rows, tmp_path, 4, batch_size=3, eos_ids=set(), chunk_size=8)
    got = sorted(r["prompt_ids"] for r in records())
    assert got == sorted(r["prompt_ids"] for r in rows)
    generate_dataset(base, rows, tmp_path, 4, batch_size=3, eos_ids=set(), chunk_size=8)  # complete: nothing redone
    assert sorted(r["prompt_ids"] for r in records()) == got
    assert len(first) == 2 and len(list(tmp_path.glob("shard-*.pt"))) == 4


def test_refill_below_one_shard_is_refused(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="engine_refill_shards must be >= 1, got 0"):
        generate_dataset(object(), [{"prompt_ids": [3, 4]}], tmp_path, 4, 2, set(), engine_refill_shards=0)
