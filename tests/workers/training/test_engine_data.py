"""Self-distillation data from the serving engine: the same responses and hidden states as the
float32 model gives each prompt, with rows finishing apart and more prompts than the engine's batch."""

from __future__ import annotations

import random

import pytest
import torch

from workers.engine_builder import load_engine
from workers.models.loader import load_model
from workers.sampling_params import SamplingParams
from workers.training.distill_data import generate_batch, generate_dataset
from workers.training.engine_data import generate_batch_engine
from workers.training.train import load_examples


def _prompts_and_eos(base, n=10):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, base.config.vocab_size) for _ in range(rng.randint(2, 14))] for _ in range(n)]
    free = generate_batch(base, prompts, 20, set())
    counts: dict[int, int] = {}
    for resp, _ in free:
        for t in set(resp[1:12]):
            counts[t] = counts.get(t, 0) + 1
    # a token the responses produce at different steps, so rows finish apart
    return prompts, max(counts, key=lambda t: (counts[t] < len(prompts), counts[t]))


def test_engine_responses_and_hiddens_equal_the_model_s(tiny_model_dirs):
    model_dir = tiny_model_dirs["tied_gqa2"]
    base = load_model(model_dir)
    prompts, eos = _prompts_and_eos(base)
    engine = load_engine(str(model_dir), None, max_batch_size=4, max_seq_len=128, decode_activations="float32")
    engine.eos_token_ids = {eos}
    got = generate_batch_engine(engine, prompts, 20)
    want = generate_batch(base, prompts, 20, {eos})
    assert len({len(r) for r, _ in got}) > 2  # some rows stop early, some run to the cap
    for (resp, hid), (want_resp, want_hid) in zip(got, want):
        assert resp == want_resp
        assert hid.shape == (len(resp), base.config.hidden_size) and hid.dtype == torch.float16
        torch.testing.assert_close(hid.float(), want_hid.float(), atol=2e-3, rtol=2e-3)
    assert engine.num_unfinished == 0


def test_engine_shards_load_as_training_examples(tiny_model_dirs, tmp_path):
    model_dir = tiny_model_dirs["tied_gqa2"]
    base = load_model(model_dir)
    prompts, eos = _prompts_and_eos(base, 12)
    engine = load_engine(str(model_dir), None, max_batch_size=8, max_seq_len=128, decode_activations="float32")
    engine.eos_token_ids = {eos}
    rows = [{"prompt_ids": p, "category": "c%d" % (i % 2)} for i, p in enumerate(prompts)]
    generate_dataset(engine, rows, tmp_path, 16, batch_size=5, eos_ids=set())
    shards = sorted(p.name for p in tmp_path.glob("shard-*.pt"))
    assert shards == ["shard-000-00000.pt", "shard-000-00001.pt", "shard-000-00002.pt"]
    records = [r for s in sorted(tmp_path.glob("shard-*.pt")) for r in torch.load(s, weights_only=False)]
    assert sorted(r["prompt_ids"] for r in records) == sorted(prompts)
    ex = load_examples(tmp_path, draft_len=2)
    assert ex.hiddens.shape[0] == sum(len(r["response_ids"]) for r in records if len(r["response_ids"]) >= 2)


def test_engine_refilled_across_shards_writes_each_shard_as_alone_and_resumes(tiny_model_dirs, tmp_path):
    """Several shards' prompts share the engine's batch; every shard holds its own prompts with the
    answers they get one shard at a time, and a missing shard is regenerated alone."""
    model_dir = tiny_model_dirs["tied_gqa2"]
    prompts, eos = _prompts_and_eos(load_model(model_dir), 14)
    engine = load_engine(str(model_dir), None, max_batch_size=4, max_seq_len=128, decode_activations="float32")
    engine.eos_token_ids = {eos}
    rows = [{"prompt_ids": p, "category": "c"} for p in prompts]

    def shards(d):
        return {s.name: [(r["prompt_ids"], r["response_ids"]) for r in torch.load(s, weights_only=False)]
                for s in sorted(d.glob("shard-*.pt"))}

    generate_dataset(engine, rows, tmp_path / "one", 16, batch_size=4, eos_ids=set(), engine_refill_shards=1)
    generate_dataset(engine, rows, tmp_path / "all", 16, batch_size=4, eos_ids=set(), engine_refill_shards=3)
    alone, together = shards(tmp_path / "one"), shards(tmp_path / "all")
    assert len(alone) == 4 and together == alone
    (tmp_path / "all" / "shard-000-00002.pt").unlink()
    generate_dataset(engine, rows, tmp_path / "all", 16, batch_size=4, eos_ids=set())
    assert shards(tmp_path / "all") == alone and engine.num_unfinished == 0


def test_engine_with_other_requests_is_refused(tiny_model_dirs):
    engine = load_engine(str(tiny_model_dirs["tied_gqa2"]), None, max_seq_len=128, decode_activations="float32")
    engine.add_request("user", [5, 6, 7], SamplingParams(max_tokens=4), "plain")
    with pytest.raises(RuntimeError, match="1 other requests"):
        generate_batch_engine(engine, [[3, 4, 5]], 8)
    assert engine.num_unfinished == 1  # the other request is left alone
