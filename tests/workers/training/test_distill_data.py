"""Self-distillation generation with rows that finish at different steps: every row's response
and hidden states are the ones the model gives that prompt alone."""

from __future__ import annotations

import random

import torch

from workers.models.loader import load_model
from workers.training.distill_data import generate_batch


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
