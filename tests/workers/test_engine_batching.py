"""In-flight batching on the tiny models: batch invariance, empty sub-batches, preemption, aborts.

Every request's greedy output must equal what the engine produces for it alone, whatever requests
share its iterations (random arrival orders, context chunks next to draft trees, plain next to
speculative requests, recompute after preemption). After any mix of finished, aborted and preempted
requests every KV block is free again.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from workers.engine import Engine
from workers.engine_builder import load_engine
from workers.sampling_params import SamplingParams


def make_engine(tiny_model_dirs, trained_drafter_dirs, variant="tied_gqa2", **options) -> Engine:
    opts = dict(num_beams=3, draft_len_per_beam=3, max_seq_len=256, max_batch_size=6, max_num_tokens=64,
                max_prefill_chunk=24, tokens_per_block=4, num_kv_blocks=400)
    opts.update(options)
    return load_engine(str(tiny_model_dirs[variant]), str(trained_drafter_dirs[variant]), **opts)


class PlanLog:
    """Wraps the scheduler to count the kinds of iterations it planned."""

    def __init__(self, engine: Engine):
        self.kinds = Counter()
        self.max_tokens_seen = 0
        schedule = engine.scheduler.schedule

        def logged(*args, **kwargs):
            plan = schedule(*args, **kwargs)
            if plan.context and not plan.generation:
                self.kinds["context only"] += 1
            if plan.generation and not plan.context:
                self.kinds["generation only"] += 1
            if plan.context and plan.generation:
                self.kinds["mixed phases"] += 1
            drafts = plan.draft_tokens
            if any(d > 0 for d in drafts) and any(d == 0 for d in drafts):
                self.kinds["spec and plain together"] += 1
            if preempted := len(plan.preempted):
                self.kinds["preemptions"] += preempted
            self.max_tokens_seen = max(self.max_tokens_seen, plan.num_tokens)
            return plan

        engine.scheduler.schedule = logged


def random_requests(rng: random.Random, n: int, vocab: int) -> list[dict]:
    return [
        {"id": f"r{i}", "prompt": [rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))],
         "max_tokens": rng.randint(1, 30), "mode": rng.choice(["spec", "plain"])}
        for i in range(n)
    ]


def alone(engine: Engine, req: dict) -> list[int]:
    deltas = list(engine.generate(req["prompt"], SamplingParams(max_tokens=req["max_tokens"]), req["mode"], req["id"]))
    return [t for d in deltas for t in d.token_ids]


def run_mixed(engine: Engine, reqs: list[dict], rng: random.Random, abort_rate: float = 0.0) -> tuple[dict, set]:
    """Submit ``reqs`` in random order at random iterations; abort some mid-way. Returns the
    outputs of the requests that finished and the ids aborted."""
    pending = reqs[:]
    rng.shuffle(pending)
    outputs: dict[str, list[int]] = {}
    finished: set[str] = set()
    aborted: set[str] = set()
    while pending or engine.num_unfinished:
        for _ in range(rng.choice([0, 0, 1, 1, 2, 4])):
            if pending:
                req = pending.pop()
                engine.add_request(req["id"], req["prompt"], SamplingParams(max_tokens=req["max_tokens"]), req["mode"])
                outputs[req["id"]] = []
        for d in engine.step():
            outputs[d.request_id] += d.token_ids
            if d.finished:
                finished.add(d.request_id)
        live = [rid for rid in outputs if rid not in finished and rid not in aborted]
        if live and rng.random() < abort_rate:
            rid = rng.choice(live)
            assert engine.abort(rid)
            aborted.add(rid)
    return {rid: outputs[rid] for rid in finished}, aborted


@pytest.mark.parametrize("variant,prefill", [("tied_gqa2", "float32"), ("untied_mqa", "float32"),
                                             ("tied_gqa2@gguf", "float32"), ("tied_gqa2@gguf", "bfloat16")])
def test_greedy_output_does_not_depend_on_the_batch(tiny_model_dirs, trained_drafter_dirs, variant, prefill):
    """Also on GGUF Q4_1/Q8_0 blocks (``@gguf``), with prompt rows in float32 or on the bfloat16
    prefill path (then a prompt's values must not depend on its chunking either)."""
    options = {"prefill_dtype": prefill} if variant.endswith("@gguf") else {}
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, variant, **options)
    assert (engine.weights is not None) == variant.endswith("@gguf")
    assert engine.prefill_dtype == prefill
    rng = random.Random(variant)
    reqs = random_requests(rng, 24, len(engine.tokenizer))
    want = {r["id"]: alone(engine, r) for r in reqs}
    log = PlanLog(engine)
    # with the bfloat16 prefill, mixed iterations run prompt chunks and decode rows in two forwards
    assert engine.runner.split_mixed == (prefill == "bfloat16")
    apart, forward_apart = [], engine.runner._forward_apart
    engine.runner._forward_apart = lambda *a: apart.append(1) or forward_apart(*a)
    for order_seed in range(3):
        got, _ = run_mixed(engine, reqs, random.Random(order_seed))
        assert got == want, f"arrival order {order_seed}"
    assert bool(apart) == (prefill == "bfloat16")
    blocks = engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    for kind in ("context only", "generation only", "mixed phases", "spec and plain together"):
        assert log.kinds[kind] > 0, f"no iteration of kind {kind!r}: {log.kinds}"
    assert log.max_tokens_seen <= engine.options.max_num_tokens


def test_trees_of_different_widths_batch_without_padding(tiny_model_dirs, trained_drafter_dirs):
    """With a (growing) prompt-lookup beam, requests' trees differ in width within one iteration:
    each width is its own attention group, no row is padded, and outputs still equal solo outputs."""
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, "tied_gqa2@gguf", prompt_lookup_num_tokens=3,
                         prompt_lookup_min=1, prompt_lookup_max_num_tokens=8)
    rng = random.Random(7)
    reqs = random_requests(rng, 24, len(engine.tokenizer))
    want = {r["id"]: alone(engine, r) for r in reqs}
    pack, mixed_widths = engine.runner._pack, []

    def checked_pack(context, rows):
        batch, *rest = pack(context, rows)
        decode = [g for g in batch.groups if g.decode]
        assert sum(g.batch * g.seq_len for g in decode) == sum(r.num_nodes for r in rows)  # no padding
        assert len({g.seq_len for g in decode}) == len(decode)  # one group per width
        if len({r.num_nodes for r in rows if r.tree is not None}) > 1:
            mixed_widths.append(sorted(r.num_nodes for r in rows))
        return (batch, *rest)

    engine.runner._pack = checked_pack
    got, _ = run_mixed(engine, reqs, random.Random(0))
    assert got == want
    assert len(mixed_widths) >= 5, f"trees of different widths met in only {len(mixed_widths)} iterations"


@pytest.mark.parametrize("variant,prefill", [("tied_gqa2", "float32"), ("tied_gqa2@gguf", "bfloat16")])
def test_preemption_and_aborts_keep_outputs_and_free_every_block(tiny_model_dirs, trained_drafter_dirs, variant,
                                                                 prefill):
    """Hundreds of requests through a KV cache of 48 blocks x 4 tokens: preemption (recompute) is
    frequent, some requests are aborted; finished requests still match their solo output. On the
    bfloat16 prefill path the recomputed generated tokens stay on the float32 kernels (only prompt
    rows take bfloat16), so recompute reproduces their values."""
    options = {"prefill_dtype": prefill} if variant.endswith("@gguf") else {}
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, variant, num_kv_blocks=48, max_batch_size=8,
                         **options)
    assert engine.prefill_dtype == prefill
    rng = random.Random(5)
    reqs = random_requests(rng, 240, len(engine.tokenizer))
    for r in reqs:
        r["prompt"] = r["prompt"][:40]
    want = {r["id"]: alone(engine, r) for r in reqs}
    log = PlanLog(engine)
    got, aborted = run_mixed(engine, reqs, rng, abort_rate=0.05)
    assert log.kinds["preemptions"] >= 10, log.kinds
    assert len(aborted) >= 5
    assert set(got) | aborted == set(want)
    assert all(got[rid] == want[rid] for rid in got)
    blocks = engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    assert all(blocks.owner(b) is None for b in range(blocks.num_blocks))


@pytest.mark.parametrize("variant", ["tied_sharp", "tied_sharp@gguf"])
def test_sampled_output_does_not_depend_on_the_batch(tiny_model_dirs, trained_drafter_dirs, variant):
    """Seeded sampling draws from a per-request generator, so batching does not change it either."""
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, variant)
    rng = random.Random(11)
    reqs = random_requests(rng, 12, len(engine.tokenizer))

    def params(r):
        return SamplingParams(temperature=0.8, top_p=0.95, seed=int(r["id"][1:]), max_tokens=r["max_tokens"])

    want = {r["id"]: [t for d in engine.generate(r["prompt"], params(r), r["mode"], r["id"]) for t in d.token_ids]
            for r in reqs}
    for r in reqs:
        engine.add_request(r["id"], r["prompt"], params(r), r["mode"])
    got = {r["id"]: [] for r in reqs}
    while engine.num_unfinished:
        for d in engine.step():
            got[d.request_id] += d.token_ids
    assert got == want


def test_bf16_prefill_recomputes_generated_tokens_as_decoding_did(tiny_model_dirs, trained_drafter_dirs):
    """A recompute chunk (prompt + generated tokens of a preempted request) gives the generated
    tokens bit for bit the hidden states decoding gave them: only prompt rows take bfloat16."""
    from dataclasses import replace

    from workers.forward_batch import contiguous_batch

    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, "tied_gqa2@gguf", prefill_dtype="bfloat16")
    assert engine.prefill_dtype == "bfloat16"
    ex = engine.executor
    prompt = torch.tensor([5, 9, 14, 3, 22, 7, 31, 8, 12, 40, 6, 17])
    generated = torch.tensor([11, 4, 29, 13])
    P = prompt.numel()
    ex.forward(contiguous_batch(prompt, 0))  # prefill (every row a prompt row)
    decoded = []
    for i, tok in enumerate(generated.tolist()):  # plain decode steps
        b = contiguous_batch(torch.tensor([tok]), P + i)
        decoded.append(ex.forward(replace(b, groups=[replace(b.groups[0], decode=True)])))
    decoded = torch.cat(decoded)
    ids = torch.cat([prompt, generated])
    marked = replace(contiguous_batch(ids, 0), prompt_rows=torch.arange(P))
    assert torch.equal(ex.forward(marked)[P:], decoded)
    unmarked = ex.forward(contiguous_batch(ids, 0))  # every row through bfloat16: not what decoding computed
    assert not torch.equal(unmarked[P:], decoded)


def test_recompute_chunks_mark_only_prompt_tokens_as_prompt_rows(tiny_model_dirs, trained_drafter_dirs):
    from workers.sequence import Sequence

    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, "tied_gqa2@gguf", prefill_dtype="bfloat16")
    fresh = Sequence("fresh", [3, 4, 5, 6, 7], max_tokens=4)
    preempted = Sequence("preempted", [8, 9, 10], max_tokens=8, output_token_ids=[11, 12, 13, 14])
    for seq in (fresh, preempted):
        engine.blocks.allocate(seq, len(seq.prompt_token_ids) + len(seq.output_token_ids) + 1)
    batch, *_ = engine.runner._pack([(fresh, 0, 5), (preempted, 0, 7)], [])
    assert batch.prompt_rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # not rows 8-11: generated tokens
    batch, *_ = engine.runner._pack([(preempted, 2, 3), (fresh, 0, 5)], [])
    assert batch.prompt_rows.tolist() == [0, 3, 4, 5, 6, 7]  # a chunk from position 2: one prompt token
    batch, *_ = engine.runner._pack([(fresh, 0, 5)], [])
    assert batch.prompt_rows is None and batch.prefill_rows == 5  # no recompute: the leading rows


def test_bf16_prefill_needs_gguf_weights(tiny_model_dirs, trained_drafter_dirs):
    with pytest.raises(ValueError, match="prefill_dtype 'bfloat16' needs the model on GGUF blocks"):
        make_engine(tiny_model_dirs, trained_drafter_dirs, "tied_gqa2", prefill_dtype="bfloat16")
    assert make_engine(tiny_model_dirs, trained_drafter_dirs, "tied_gqa2", prefill_dtype="auto").prefill_dtype == "float32"


def test_int8_activations_and_lookup_settings_fail_clearly(tiny_model_dirs, trained_drafter_dirs):
    with pytest.raises(ValueError, match="decode_activations 'int8' needs the model on GGUF blocks.*tp_size 1"):
        make_engine(tiny_model_dirs, trained_drafter_dirs, "tied_gqa2", decode_activations="int8")
    assert make_engine(tiny_model_dirs, trained_drafter_dirs, "tied_gqa2").decode_activations == "float32"
    with pytest.raises(ValueError, match=r"decode_activations\n  Input should be 'auto', 'float32' or 'int8'"):
        make_engine(tiny_model_dirs, trained_drafter_dirs, "tied_gqa2", decode_activations="int4")
    with pytest.raises(ValueError, match=r"prompt_lookup_num_tokens\n  Input should be greater than or equal to 0"):
        make_engine(tiny_model_dirs, trained_drafter_dirs, "tied_gqa2", prompt_lookup_num_tokens=-1)
    with pytest.raises(ValueError, match="speculation.prompt_lookup_max_num_tokens: set, but speculation.prompt_lookup_num_tokens is 0"):
        make_engine(tiny_model_dirs, trained_drafter_dirs, "tied_gqa2", prompt_lookup_max_num_tokens=8)


def test_prompt_chunks_and_decode_rows_apart_give_the_joint_forwards_bits(tiny_model_dirs, trained_drafter_dirs):
    """With the bfloat16 prefill a mixed iteration runs its prompt chunks and decode rows in two forwards
    (``ModelRunner._forward_apart``): every hidden state the step reads (logit rows, each request's
    last prompt row, each tree's first row, where the drafter takes its context) must be the joint
    forward's, bit for bit, at the same index."""
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, "tied_gqa2@gguf", prefill_dtype="bfloat16")
    runner = engine.runner
    assert runner.split_mixed
    apart, checked = runner._forward_apart, []

    def both(context, rows):
        hidden, logit_rows, last_rows, row_starts, prompt_rows = apart(context, rows)
        batch, j_logit_rows, j_last_rows, j_row_starts, j_prompt_rows = runner._pack(context, rows)
        joint = runner.executor.forward(batch)  # rewrites the same cache slots with the same values
        assert (logit_rows, last_rows, row_starts, prompt_rows) == (j_logit_rows, j_last_rows, j_row_starts, j_prompt_rows)
        read = sorted(set(logit_rows) | set(last_rows) | set(row_starts))
        assert torch.equal(hidden[read], joint[read])
        checked.append(len(rows))
        return hidden, logit_rows, last_rows, row_starts, prompt_rows

    runner._forward_apart = both
    reqs = random_requests(random.Random(11), 16, len(engine.tokenizer))
    run_mixed(engine, reqs, random.Random(1))
    assert len(checked) >= 3, f"only {len(checked)} mixed iterations"
