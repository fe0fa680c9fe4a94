"""Speculative sampling keeps the base model's distribution (ReDrafter arXiv 2403.09919 Sec. 3.3,
with the exact acceptance rule for beam-search drafts in ``workers/redrafter/acceptance.py``).

Many seeded runs of spec and plain decoding on the tiny model (self-distilled drafter) are compared
with two-sample chi-square tests per output position and on (token 2, token 3) pairs. Master seeds
are fixed, so the test is deterministic.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from scipy.stats import chi2_contingency

from tiny_gguf import weights_variant
from workers.engine import Engine
from workers.engine_builder import load_engine
from workers.sampling_params import SamplingParams

RUNS = 1200
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def engines(tiny_model_dirs, trained_drafter_dirs):
    """``engines(weights)``: the sharp tiny model on float32 weights or on its GGUF Q4_1/Q8_0 blocks."""
    made = {}

    def get(weights: str = "float32") -> Engine:
        if weights not in made:
            name = weights_variant("tied_sharp", weights)
            made[weights] = load_engine(str(tiny_model_dirs[name]), str(trained_drafter_dirs[name]),
                                   num_beams=4, draft_len_per_beam=3, max_seq_len=128)
            assert (made[weights].weights is not None) == (weights == "gguf")
        return made[weights]

    return get


@pytest.fixture(scope="module")
def engine(engines):
    return engines("float32")


def outputs(engine: Engine, prompt: list[int], params: SamplingParams, mode: str, master_seed: int):
    """``(list of output token tuples, number of runs with an accepted draft token)``."""
    seeds = random.Random(master_seed).sample(range(10**9), RUNS)
    results, runs_with_accepts = [], 0
    for seed in seeds:
        deltas = list(engine.generate(prompt, SamplingParams(**{**params.__dict__, "seed": seed}), mode))
        results.append(tuple(t for d in deltas for t in d.token_ids))
        runs_with_accepts += deltas[-1].accepted_draft_tokens > 0
    return results, runs_with_accepts


def chi2_pvalue(a: Counter, b: Counter, min_count: int = 10) -> float:
    """Two-sample chi-square p-value; categories with fewer than ``min_count`` pooled counts are
    merged into one bucket (dropped if that bucket is still too small)."""
    keys = [k for k in a.keys() | b.keys() if a[k] + b[k] >= min_count]
    rare = [k for k in a.keys() | b.keys() if a[k] + b[k] < min_count]
    table = [[a[k] for k in keys], [b[k] for k in keys]]
    if sum(a[k] + b[k] for k in rare) >= min_count:
        table[0].append(sum(a[k] for k in rare))
        table[1].append(sum(b[k] for k in rare))
    if len(table[0]) < 2:
        return 1.0
    return chi2_contingency(table)[1]


def assert_same_distribution(spec: list[tuple], plain: list[tuple], positions: int, joint: slice) -> None:
    """Chi-square at each output position, and on the tokens at ``joint`` taken together."""
    for pos in range(positions):
        a, b = Counter(o[pos] for o in spec), Counter(o[pos] for o in plain)
        assert len(a | b) >= 2, "degenerate distribution: the test would be vacuous"
        p = chi2_pvalue(a, b)
        assert p > 1e-3, f"position {pos}: p={p:.2e}"
    p = chi2_pvalue(Counter(o[joint] for o in spec), Counter(o[joint] for o in plain))
    assert p > 1e-3, f"tokens {joint.start}..{joint.stop - 1} together: p={p:.2e}"


@pytest.mark.parametrize(
    "params, prompt_seed, weights",
    [
        (SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, ignore_eos=True), 3, "float32"),
        (SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, top_p=0.9, ignore_eos=True), 5, "float32"),
        (SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, ignore_eos=True), 3, "gguf"),
    ],
    ids=["temperature", "top_k_top_p", "temperature_gguf"],
)
def test_spec_sampling_matches_plain_distribution(engines, params, prompt_seed, weights):
    engine = engines(weights)
    rng = random.Random(prompt_seed)
    prompt = [rng.randrange(3, len(engine.tokenizer)) for _ in range(12)]
    spec, spec_accepting = outputs(engine, prompt, params, "spec", master_seed=1)
    plain, _ = outputs(engine, prompt, params, "plain", master_seed=2)
    assert all(len(o) == MAX_TOKENS for o in spec + plain)
    assert spec_accepting >= RUNS // 4, f"drafts accepted in only {spec_accepting}/{RUNS} runs"
    assert_same_distribution(spec, plain, MAX_TOKENS, slice(2, 4))


def test_spec_sampling_with_a_prompt_lookup_beam_matches_plain_distribution(tiny_model_dirs, trained_drafter_dirs):
    """A 1 x 1 ReDrafter tree plus a 3-token prompt-lookup beam (matched on 1- to 3-grams), 8 tokens
    (the sharp tiny model often repeats what it sampled, which the lookup beam drafts): the output
    distribution is still the base model's at every position, and steps that accept 2+ draft tokens
    (only the lookup beam reaches that deep) occur in many runs."""
    engine = load_engine(str(tiny_model_dirs["tied_sharp"]), str(trained_drafter_dirs["tied_sharp"]),
                    num_beams=1, draft_len_per_beam=1, max_seq_len=128,
                    prompt_lookup_num_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    rng = random.Random(11)
    prompt = [rng.randrange(3, len(engine.tokenizer)) for _ in range(12)]
    params = SamplingParams(max_tokens=8, temperature=0.8, ignore_eos=True)
    seeds = random.Random(1).sample(range(10**9), RUNS)
    spec, deep_runs = [], 0
    for seed in seeds:
        deltas = list(engine.generate(prompt, SamplingParams(**{**params.__dict__, "seed": seed}), "spec"))
        spec.append(tuple(t for d in deltas for t in d.token_ids))
        deep_runs += any(b.accepted_draft_tokens - a.accepted_draft_tokens >= 2 for a, b in zip(deltas, deltas[1:]))
    plain, _ = outputs(engine, prompt, params, "plain", master_seed=2)
    assert deep_runs >= RUNS // 10, f"the lookup beam was accepted past depth 1 in only {deep_runs}/{RUNS} runs"
    assert all(len(o) == 8 for o in spec + plain)
    assert_same_distribution(spec, plain, 8, slice(2, 5))


def test_spec_sampling_detects_a_biased_sampler(engine):
    """The comparison has power: plain runs at a different temperature are told apart."""
    rng = random.Random(3)
    prompt = [rng.randrange(3, len(engine.tokenizer)) for _ in range(12)]
    a, _ = outputs(engine, prompt, SamplingParams(max_tokens=2, temperature=0.8, ignore_eos=True), "plain", 1)
    b, _ = outputs(engine, prompt, SamplingParams(max_tokens=2, temperature=1.0, ignore_eos=True), "plain", 2)
    assert chi2_pvalue(Counter(o[1] for o in a), Counter(o[1] for o in b)) < 1e-3


@pytest.mark.parametrize("weights", ["float32", "gguf"])
@pytest.mark.parametrize("mode", ["spec", "plain"])
def test_seeded_sampling_is_deterministic(engines, mode, weights):
    engine = engines(weights)
    rng = random.Random(9)
    prompt = [rng.randrange(3, len(engine.tokenizer)) for _ in range(12)]
    runs = {}
    for seed in range(8):
        params = SamplingParams(max_tokens=12, temperature=0.8, seed=seed, ignore_eos=True)
        first = [t for d in engine.generate(prompt, params, mode) for t in d.token_ids]
        second = [t for d in engine.generate(prompt, params, mode) for t in d.token_ids]
        assert first == second, f"seed {seed}"
        runs[seed] = tuple(first)
    assert len(set(runs.values())) > 1, "different seeds gave one output: the seed is not used"


@pytest.mark.parametrize("weights", ["float32", "gguf"])
def test_a_seed_gives_the_same_text_with_and_without_drafting(engines, tiny_model_dirs, trained_drafter_dirs, weights):
    """Each token's draw is keyed by (seed, position), so a seeded sampled request emits the same
    tokens in plain steps, through a 4x3 tree and through a 1x1 tree with a lookup beam: its text does
    not depend on the decoding mode the router picks (the same rows compute the same bits)."""
    wide = engines(weights)
    name = weights_variant("tied_sharp", weights)
    narrow = load_engine(str(tiny_model_dirs[name]), str(trained_drafter_dirs[name]), num_beams=1, draft_len_per_beam=1,
                    max_seq_len=128, prompt_lookup_num_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    rng = random.Random(13)
    prompt = [rng.randrange(3, len(wide.tokenizer)) for _ in range(12)]
    accepted, texts = 0, set()
    for seed in range(12):
        params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)
        plain = [t for d in wide.generate(prompt, params, "plain") for t in d.token_ids]
        for engine in (wide, narrow):
            deltas = list(engine.generate(prompt, params, "spec"))
            assert [t for d in deltas for t in d.token_ids] == plain, f"seed {seed}"
            accepted += deltas[-1].accepted_draft_tokens
        texts.add(tuple(plain))
    assert accepted >= 24, "too few drafts accepted for the comparison to mean anything"
    assert len(texts) > 6, "the seeds barely change the output: the test would be vacuous"
