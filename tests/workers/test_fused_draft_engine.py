"""The engine drafts in one C call (workers/redrafter/fused_draft.py) exactly when that proposes what
its configured search proposes, the proposals are the Python search's, and greedy speculative output
still equals plain output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from workers import model_runner
from workers.engine_builder import load_engine
from workers.kernels import build
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not build.available(), reason="needs rdserve's CPU kernels (a C compiler, AVX2)")

VARIANT = "tied_gqa2@gguf"


@pytest.fixture(scope="module")
def restricted(tiny_model_dirs, trained_drafter_dirs, tmp_path_factory):
    """(model dir, drafter dir): the tiny model's trained drafter with a draft vocabulary (the C path
    needs one; the full-vocabulary head is a plain tensor)."""
    model_dir = Path(tiny_model_dirs[VARIANT])
    drafter_dir = tmp_path_factory.mktemp("restricted") / "drafter"
    shutil.copytree(trained_drafter_dirs[VARIANT], drafter_dir, ignore=shutil.ignore_patterns("shards"))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    (drafter_dir / "draft_vocab.json").write_text(json.dumps(list(range(vocab - 40))))
    return model_dir, drafter_dir


def decode_together(engine, prompts: dict[str, list[int]], params) -> dict[str, list[int]]:
    """Every prompt added as a ``spec`` request at once, stepped until all finish: request id -> tokens."""
    got = {rid: [] for rid in prompts}
    for rid, p in prompts.items():
        engine.add_request(rid, p, params, "spec")
    while engine.num_unfinished:
        for d in engine.step():
            got[d.request_id] += d.token_ids
    return got


@pytest.mark.parametrize("search, beams, depth, fused", [
    ("beam", 1, 3, True), ("beam", 3, 1, True), ("beam", 2, 2, False), ("distinct_first", 2, 3, True),
])
def test_the_engine_drafts_in_c_when_the_beams_are_the_same(restricted, monkeypatch, search, beams, depth, fused):
    model_dir, drafter_dir = restricted
    engine = load_engine(str(model_dir), str(drafter_dir), num_beams=beams, draft_len_per_beam=depth, max_seq_len=256,
                    draft_search=search)
    assert engine.drafter.draft_vocab is not None
    python_search = {"beam": model_runner.draft_beams_batch,
                     "distinct_first": model_runner.draft_distinct_first_batch}[search]
    real_fused = model_runner.draft_distinct_first_fused
    calls = {"fused": 0, "python": 0}

    def spy_fused(drafter, embed_weight, context, roots, num_beams, draft_len, with_probs=False):
        assert not with_probs, "a fixed shape is verified whole"
        got = real_fused(drafter, embed_weight, context, roots, num_beams, draft_len)
        assert got is not None, "the engine's drafter should take the C path"
        want = python_search(drafter, lambda ids: embed_weight[ids], context, roots, num_beams, draft_len)
        assert torch.equal(got, want)
        calls["fused"] += 1
        return got

    def spy_python(search_fn):
        def call(*args):
            calls["python"] += 1
            return search_fn(*args)
        return call

    monkeypatch.setattr(model_runner, "draft_distinct_first_fused", spy_fused)
    monkeypatch.setattr(model_runner, "draft_beams_batch", spy_python(model_runner.draft_beams_batch))
    monkeypatch.setattr(model_runner, "draft_distinct_first_batch", spy_python(model_runner.draft_distinct_first_batch))
    for prompt in ([5, 17, 33, 8, 91], [200, 3, 3, 3, 150, 42, 7]):
        params = SamplingParams(max_tokens=24)
        plain = [t for d in engine.generate(prompt, params, "plain") for t in d.token_ids]
        spec = [t for d in engine.generate(prompt, params, "spec") for t in d.token_ids]
        assert spec == plain
    assert calls["fused"] > 0 if fused else calls["fused"] == 0
    assert calls["python"] == 0 if fused else calls["python"] > 0


def test_batched_requests_draft_together_in_c(restricted, monkeypatch):
    """Several speculative requests in one iteration share one C draft call (a row per request), and
    each output still equals its plain output alone."""
    model_dir, drafter_dir = restricted
    engine = load_engine(str(model_dir), str(drafter_dir), num_beams=2, draft_len_per_beam=2, max_seq_len=256)
    real_fused = model_runner.draft_distinct_first_fused
    batch_sizes = []

    def spy_fused(drafter, embed_weight, context, roots, num_beams, draft_len, with_probs=False):
        got = real_fused(drafter, embed_weight, context, roots, num_beams, draft_len)
        want = model_runner.draft_distinct_first_batch(drafter, lambda ids: embed_weight[ids], context, roots,
                                                       num_beams, draft_len)
        assert torch.equal(got, want)
        batch_sizes.append(context.shape[0])
        return got

    prompts = {f"r{i}": [7 + i, 40 + 3 * i, 11, 90 - i, 5 + 2 * i][: 2 + i] for i in range(4)}
    params = SamplingParams(max_tokens=20)
    want = {rid: [t for d in engine.generate(p, params, "plain") for t in d.token_ids] for rid, p in prompts.items()}
    monkeypatch.setattr(model_runner, "draft_distinct_first_fused", spy_fused)
    assert decode_together(engine, prompts, params) == want
    assert max(batch_sizes) == len(prompts)


@pytest.mark.parametrize("fused", [True, False])
def test_trees_cut_by_the_drafters_confidence_verify_fewer_rows_and_keep_the_output(restricted, monkeypatch, fused):
    """With a path-probability threshold (``speculation.auto.prune_trees``), each request verifies only
    the draft tokens its drafter is sure enough of: fewer rows than the whole 2x3 shape, some steps no
    draft token at all, and every output still equals its plain output (C draft and Python draft)."""
    model_dir, drafter_dir = restricted
    engine = load_engine(str(model_dir), str(drafter_dir), num_beams=2, draft_len_per_beam=3, max_seq_len=256)
    if not fused:
        monkeypatch.setattr(model_runner, "draft_distinct_first_fused", lambda *a, **k: None)
    prompts = {f"r{i}": [7 + i, 40 + 3 * i, 11, 90 - i, 5 + 2 * i][: 2 + i] for i in range(4)}
    params = SamplingParams(max_tokens=20)
    want = {rid: [t for d in engine.generate(p, params, "plain") for t in d.token_ids] for rid, p in prompts.items()}
    kept = []
    real_prune = model_runner.prune_beams

    def spy_prune(beams, probs, min_prob):
        out = real_prune(beams, probs, min_prob)
        assert min_prob == 0.02 and all(0.0 < p <= 1.0 for row in probs for p in row)
        kept.append((sum(len(b) - 1 for b in beams), sum(len(b) - 1 for b in out)))
        return out

    monkeypatch.setattr(model_runner, "prune_beams", spy_prune)
    monkeypatch.setattr(engine.spec_policy, "min_draft_prob", lambda b, shape: 0.02)
    reported = []  # (drafted, rows) as the policy hears of each step
    real_observe = engine.spec_policy.observe
    monkeypatch.setattr(engine.spec_policy, "observe", lambda state, shape, drafted, accepted, rows=None: (
        reported.append((drafted, rows)), real_observe(state, shape, drafted, accepted, rows)))
    assert decode_together(engine, prompts, params) == want
    assert kept and max(w for w, _ in kept) == 6  # the whole 2x3 shape (fewer near max_tokens)
    assert sum(k for _, k in kept) < sum(w for w, _ in kept)
    assert any(k == 0 for _, k in kept) and any(k > 0 for _, k in kept)
    # a request whose every draft token was cut made a plain step, and the policy hears of it as one
    assert (False, 1) in reported and all(rows > 1 for drafted, rows in reported if drafted)
