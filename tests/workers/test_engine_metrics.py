"""The engine's metric counts (``workers.engine_metrics``) against the deltas it streamed, in process.

Batches of speculative and plain requests, some cut by a stop string, some preempted (a small KV
cache), one aborted: every count equals the sum over what the requests emitted.
"""

from __future__ import annotations

import random

from workers.engine import Engine
from workers.engine_builder import load_engine
from workers.engine_metrics import EngineStats
from workers.sampling_params import SamplingParams


def make_engine(tiny_model_dirs, trained_drafter_dirs, **options) -> Engine:
    opts = dict(num_beams=3, draft_len_per_beam=3, max_seq_len=256, max_batch_size=6, max_num_tokens=96,
                max_prefill_chunk=24, tokens_per_block=4, num_kv_blocks=400)
    opts.update(options)
    engine = load_engine(str(tiny_model_dirs["untied_mqa"]), str(trained_drafter_dirs["untied_mqa"]), **opts)
    engine.stats = EngineStats()
    return engine


def run_batch(engine: Engine, requests: list[dict]) -> dict[str, object]:
    """Add all requests, step to completion; the final delta of each request."""
    for r in requests:
        engine.add_request(r["id"], r["prompt"], r["params"], r["mode"])
    last = {}
    while engine.num_unfinished:
        for d in engine.step():
            last[d.request_id] = d
    return last


def requests_for(engine: Engine, n: int, seed: int = 0, stop: tuple[str, ...] = ()) -> list[dict]:
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    return [{"id": f"r{seed}-{i}", "prompt": [rng.randrange(3, vocab) for _ in range(rng.randint(2, 40))],
             "params": SamplingParams(max_tokens=rng.randint(8, 40), stop=stop),
             "mode": rng.choice(["spec", "spec", "plain"])}
            for i in range(n)]


def check_counts(d, last: dict) -> None:
    finals = list(last.values())
    assert d.generation_tokens == sum(f.completion_tokens for f in finals)
    assert d.prompt_tokens == sum(f.prompt_tokens for f in finals)
    assert d.accepted_tokens == sum(f.accepted_draft_tokens for f in finals)
    assert d.generation_steps == sum(f.num_steps for f in finals)
    assert 0 < d.accepted_tokens <= d.draft_tokens and d.drafts <= d.generation_steps
    assert sum(d.accepted_per_pos) == d.accepted_tokens
    assert d.accepted_per_pos == sorted(d.accepted_per_pos, reverse=True) and d.accepted_per_pos[0] <= d.drafts
    assert len(d.first_tokens) == len(d.finished) == len(finals)
    assert all(t.queue_s >= 0 and t.prefill_s > 0 and t.decode_s >= 0 for t in d.finished)


def test_counts_equal_what_the_requests_emitted(tiny_model_dirs, trained_drafter_dirs):
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs)
    last = run_batch(engine, requests_for(engine, 8))
    d = engine.drain_stats()
    check_counts(d, last)
    kinds = {k for k, _ in d.iterations}
    assert {"context", "spec"} <= kinds and all(s > 0 for _, s in d.iterations)
    assert (d.num_running, d.num_waiting, d.kv_cache_usage) == (0, 0, 0.0)
    assert d.spec_shape in ((0, 0), (3, 3))
    again = engine.drain_stats()  # drained: counts start again from zero
    assert (again.generation_tokens, again.drafts, again.iterations) == (0, 0, [])


def test_nothing_counted_after_a_stop_string(tiny_model_dirs, trained_drafter_dirs):
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs)
    reqs = requests_for(engine, 6, seed=1)
    full = run_batch(engine, reqs)
    engine.drain_stats()
    texts = {}
    for r in reqs:  # each request's full text, to cut it with a stop string from its middle
        texts[r["id"]] = "".join(d.text for d in engine.generate(r["prompt"], r["params"], r["mode"], r["id"] + "x"))
    engine.drain_stats()
    stopped = [dict(r, id=r["id"] + "s", params=SamplingParams(max_tokens=r["params"].max_tokens,
                                                               stop=(texts[r["id"]][len(texts[r["id"]]) // 2:][:2],)))
               for r in reqs if len(texts[r["id"]]) > 8]
    last = run_batch(engine, stopped)
    assert any(d.finish_reason == "stop" and d.completion_tokens < full[r["id"][:-1]].completion_tokens
               for r, d in ((r, last[r["id"]]) for r in stopped))
    check_counts(engine.drain_stats(), last)


def test_preemptions_and_aborts_are_counted(tiny_model_dirs, trained_drafter_dirs):
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, num_kv_blocks=40)
    reqs = requests_for(engine, 6, seed=2)
    for r in reqs:
        r["params"] = SamplingParams(max_tokens=40)
    engine.add_request("gone", reqs[0]["prompt"], SamplingParams(max_tokens=40), "spec")
    engine.step()
    engine.abort("gone")
    last = run_batch(engine, reqs)
    d = engine.drain_stats()
    assert d.num_preemptions > 0 and d.aborted == 1
    # the aborted request's emitted tokens are counted too (it got its first token before the abort)
    gone = d.generation_tokens - sum(f.completion_tokens for f in last.values())
    assert gone >= 0 and d.prompt_tokens - sum(f.prompt_tokens for f in last.values()) in (0, len(reqs[0]["prompt"]))


def test_snapshot_and_abort_all(tiny_model_dirs, trained_drafter_dirs):
    """``snapshot`` reports the queues and the KV cache; ``abort_all`` ends every request through
    ``abort`` (each counted as aborted) and frees every block."""
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, max_batch_size=2)
    reqs = requests_for(engine, 3, seed=3)
    for r in reqs:
        engine.add_request(r["id"], r["prompt"], r["params"], r["mode"])
    engine.step()
    snap = engine.snapshot()
    assert (snap.running, snap.waiting, snap.failure) == (2, 1, None)
    assert snap.free_blocks < snap.num_blocks == snap.kv_size.num_blocks and 0 < snap.kv_usage < 1
    assert {"shape", "tau"} <= set(snap.spec_stats)
    assert sorted(engine.abort_all()) == sorted(r["id"] for r in reqs)
    snap = engine.snapshot()
    assert (snap.running, snap.waiting, snap.free_blocks) == (0, 0, snap.num_blocks) and not engine.num_unfinished
    assert engine.drain_stats().aborted == 3
