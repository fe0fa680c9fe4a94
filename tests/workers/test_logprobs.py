"""Logprobs are exact under speculation: speculative and plain decoding report identical logprobs for
every emitted token (greedy and seeded sampling, float32 and GGUF int8 weights, stops inside accepted
blocks), equal within float tolerance to a teacher-forced pass over the whole output (the engine's own
prompt logprobs), and are cut exactly where the output is.
"""

from __future__ import annotations

import math
import random

import pytest

from test_lossless import random_prompt, stop_strings
from spec_engines import engine_4x4_factory
from tiny_gguf import weights_variant
from workers.engine_builder import load_engine
from workers.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engines(tiny_model_dirs, trained_drafter_dirs):
    return engine_4x4_factory(tiny_model_dirs, trained_drafter_dirs)


def run(engine, prompt, params, mode):
    """(token ids, logprob entries, deltas); each delta's logprobs match its tokens one to one."""
    deltas = list(engine.generate(prompt, params, mode))
    for d in deltas:
        assert d.logprobs is not None and [e.token_id for e in d.logprobs] == d.token_ids
    tokens = [t for d in deltas for t in d.token_ids]
    return tokens, [e for d in deltas for e in d.logprobs], deltas


def as_tuples(entries):
    return [(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top]) for e in entries]


@pytest.mark.parametrize("weights", ["float32", "gguf"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_spec_and_plain_report_identical_logprobs(engines, weights, sampled):
    """Eight random prompts, top 5 alternatives, some with a stop string from the plain text: the
    same tokens and bit-identical logprobs; drafted blocks of 2+ tokens occurred."""
    engine = engines(weights_variant("tied_sharp" if sampled else "tied_gqa2", weights))  # sharp: drafts accepted
    multi = 0
    for case in range(8):
        rng = random.Random(case)
        prompt = random_prompt(rng, len(engine.tokenizer), 40)
        params = SamplingParams(max_tokens=rng.randint(5, 40), logprobs=5, temperature=0.8 if sampled else 0.0,
                                seed=case if sampled else None, ignore_eos=True)
        plain, plain_lp, _ = run(engine, prompt, params, "plain")
        stops = stop_strings(engine.tokenizer.decode(plain))
        if case % 2 and stops:
            params = SamplingParams(**{**params.__dict__, "stop": (rng.choice(stops),)})
            plain, plain_lp, _ = run(engine, prompt, params, "plain")
        spec, spec_lp, deltas = run(engine, prompt, params, "spec")
        assert spec == plain
        assert as_tuples(spec_lp) == as_tuples(plain_lp), f"case {case}"
        multi += sum(len(d.token_ids) >= 3 for d in deltas[1:])
    assert multi >= 3, "few multi-token steps: the comparison is weak"


@pytest.mark.parametrize("weights", ["float32", "gguf"])
def test_logprobs_equal_a_teacher_forced_pass(tiny_model_dirs, trained_drafter_dirs, weights):
    """The logprob of output token k equals the prompt logprob of the same token when prompt +
    output is fed as one prompt (a teacher-forced forward; prompt rows may take another kernel path,
    hence the tolerance); the top alternatives agree; greedy tokens are their row's top choice.
    Prompt rows stay float32 (``prefill_dtype``): on a CPU with AMX the default puts them in
    bfloat16, whose rounding (4.5e-3 here on a Xeon) is not what this compares."""
    variant = weights_variant("untied_mqa", weights)
    engine = load_engine(str(tiny_model_dirs[variant]), str(trained_drafter_dirs["untied_mqa"]), num_beams=4,
                         draft_len_per_beam=4, max_seq_len=256, prefill_dtype="float32")
    assert engine.prefill_dtype == "float32"
    rng = random.Random(5)
    for _ in range(3):
        prompt = random_prompt(rng, len(engine.tokenizer), 30)
        tokens, entries, _ = run(engine, prompt, SamplingParams(max_tokens=24, logprobs=3, ignore_eos=True), "spec")
        forced = list(engine.generate(prompt + tokens, SamplingParams(max_tokens=1, prompt_logprobs=3), "plain"))
        teacher = forced[0].prompt_logprobs
        assert len(teacher) == len(prompt) + len(tokens) and teacher[0].logprob is None
        for k, entry in enumerate(entries):
            ref = teacher[len(prompt) + k]
            assert ref.token_id == entry.token_id
            assert math.isclose(entry.logprob, ref.logprob, abs_tol=2e-3), (k, entry.logprob, ref.logprob)
            assert entry.top[0].token_id == entry.token_id  # greedy: the argmax
            assert entry.top[0].logprob == entry.logprob
            assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)


def test_logprobs_are_cut_with_the_output_at_max_tokens_and_stops(engines):
    """max_tokens at every value, and stop strings inside accepted blocks: as many logprob entries as
    output tokens, and they are the uncut run's first entries."""
    engine = engines("tied_gqa2")
    prompt = random_prompt(random.Random(3), len(engine.tokenizer), 30)
    full, full_lp, _ = run(engine, prompt, SamplingParams(max_tokens=30, logprobs=2, ignore_eos=True), "spec")
    for n in range(1, 30, 3):
        tokens, entries, deltas = run(engine, prompt, SamplingParams(max_tokens=n, logprobs=2, ignore_eos=True), "spec")
        assert tokens == full[:n] and as_tuples(entries) == as_tuples(full_lp[:n])
        assert deltas[-1].completion_tokens == len(entries)
    text = engine.tokenizer.decode(full)
    for stop in stop_strings(text)[:12]:
        tokens, entries, deltas = run(engine, prompt, SamplingParams(max_tokens=30, logprobs=0, stop=(stop,),
                                                                     ignore_eos=True), "spec")
        assert len(entries) == len(tokens) == deltas[-1].completion_tokens
        assert as_tuples(entries) == [(t, lp, []) for t, lp, _ in as_tuples(full_lp[: len(tokens)])]


def test_prompt_logprobs_cover_every_prompt_token_across_chunks(tiny_model_dirs):
    """A prompt prefilled in several chunks gets one entry per token (None first), each naming the
    prompt token and equal to a one-chunk prefill's value."""
    prompt = random_prompt(random.Random(9), 300, 90)
    values = []
    for chunk in (16, 256):
        engine = load_engine(str(tiny_model_dirs["tied_gqa2"]), None, max_seq_len=256, max_prefill_chunk=chunk,
                             max_num_tokens=max(chunk, 32))
        first = next(engine.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=1), "plain"))
        entries = first.prompt_logprobs
        assert entries[0].logprob is None and [e.token_id for e in entries] == prompt
        assert all(len(e.top) == 1 for e in entries[1:])
        values.append([e.logprob for e in entries[1:]])
    assert values[0] == pytest.approx(values[1], abs=1e-4)


def test_token_text_rebuilds_split_characters(engines):
    """Byte-level tokens: the bytes of a text's tokens join to the text's UTF-8 bytes."""
    engine = engines("tied_gqa2")
    text = "naïve café – 東京"
    ids = engine.encode_prompt(text)
    joined = b"".join(bytes(engine.token_text(i)[1]) for i in ids)
    assert joined.decode("utf-8") == text
