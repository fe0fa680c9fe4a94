"""Logit bias, min_tokens and repetition/frequency/presence penalties, exact under speculation.

Each draft-tree node's row is processed with its own path's history: checked against a direct
per-path computation, and end to end: speculative output equals plain output (greedy, and seeded
sampling, whose keyed draws make it token-identical), while the processors do change the output.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from test_lossless import random_prompt
from spec_engines import engine_4x4_factory
from tiny_gguf import weights_variant
from workers.logits_processing import process_logits, prompt_presence
from workers.redrafter.tree import build_prefix_tree
from workers.sampling_params import SamplingParams


def reference(logits_row: torch.Tensor, params: SamplingParams, prompt: list[int], history: list[int],
              stop_ids: set[int]) -> torch.Tensor:
    """One row processed from an explicit output history (the tokens before the predicted one)."""
    out = logits_row.clone()
    for token, bias in params.logit_bias:
        out[token] += bias
    if len(history) < params.min_tokens:
        for token in stop_ids:
            out[token] = float("-inf")
    for token in set(prompt) | set(history):
        if params.repetition_penalty != 1.0:
            out[token] = out[token] / params.repetition_penalty if out[token] > 0 else out[token] * params.repetition_penalty
    for token in set(history):
        out[token] -= params.frequency_penalty * history.count(token) + params.presence_penalty
    return out


def test_each_tree_node_is_processed_with_its_own_path():
    rng = random.Random(0)
    vocab = 12
    for case in range(40):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        beams = [[output[-1]] + [rng.randrange(vocab) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 4))]
        tree = build_prefix_tree(beams)
        params = SamplingParams(repetition_penalty=rng.choice([1.0, 1.3, 0.8]), frequency_penalty=rng.uniform(-1, 1),
                                presence_penalty=rng.uniform(-1, 1), min_tokens=rng.randint(0, 9),
                                logit_bias=((rng.randrange(vocab), rng.uniform(-5, 5)),))
        stop_ids = {rng.randrange(vocab)}
        logits = torch.randn(tree.num_nodes, vocab)
        got = process_logits(logits, params, output, prompt_presence(prompt, vocab), tree.depths,
                             tree.tokens[1:], tree.mask[:, 1:], stop_ids)
        for i in range(tree.num_nodes):
            path = [j for j in range(1, tree.num_nodes) if tree.mask[i, j]]
            history = output + tree.tokens[path].tolist()
            want = reference(logits[i], params, prompt, history, stop_ids)
            torch.testing.assert_close(got[i], want, msg=f"case {case} node {i}")


def test_a_complete_grammar_ends_the_output_despite_min_tokens():
    """Rows where the grammar allows only a stop token keep it under min_tokens (else every logit
    would be -inf); rows where it allows more lose their stop tokens."""
    logits = torch.randn(2, 6)
    allowed = torch.tensor([[False, False, True, False, False, False], [True, True, True, False, False, False]])
    out = process_logits(logits, SamplingParams(min_tokens=10), [1], None, stop_ids={2}, allowed=allowed)
    assert out[0].argmax() == 2 and torch.isfinite(out[0, 2])
    assert out[1, 2] == float("-inf") and torch.isfinite(out[1, :2]).all() and (out[:, 3:] == float("-inf")).all()


def test_without_processors_the_logits_are_untouched():
    logits = torch.randn(3, 10)
    assert process_logits(logits, SamplingParams(), [1, 2], None) is logits


@pytest.fixture(scope="module")
def engines(tiny_model_dirs, trained_drafter_dirs):
    return engine_4x4_factory(tiny_model_dirs, trained_drafter_dirs)


def tokens_of(engine, prompt, params, mode) -> tuple[list[int], str, int]:
    deltas = list(engine.generate(prompt, params, mode))
    return [t for d in deltas for t in d.token_ids], deltas[-1].finish_reason, deltas[-1].accepted_draft_tokens


def random_processors(rng: random.Random, vocab: int) -> dict:
    return dict(repetition_penalty=rng.choice([1.0, 1.2, 1.5]), frequency_penalty=rng.choice([0.0, 0.5, 1.5]),
                presence_penalty=rng.choice([0.0, 0.7, -0.5]),
                logit_bias=tuple((rng.randrange(vocab), rng.choice([-100.0, 5.0, 2.0])) for _ in range(rng.randint(0, 3))))


@pytest.mark.parametrize("weights", ["float32", "gguf"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_spec_equals_plain_with_penalties_and_bias(engines, weights, sampled):
    """12 random cases of penalties and biases: speculative output is token-identical to plain; the
    processors changed the output in most cases, and drafts were accepted."""
    engine = engines(weights_variant("tied_sharp" if sampled else "tied_gqa2", weights))
    changed = accepted = 0
    for case in range(12):
        rng = random.Random(100 + case)
        prompt = random_prompt(rng, len(engine.tokenizer), 30)
        base = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.9 if sampled else 0.0,
                              seed=case if sampled else None)
        params = replace(base, **random_processors(rng, len(engine.tokenizer)))
        plain, _, _ = tokens_of(engine, prompt, params, "plain")
        spec, _, spec_accepted = tokens_of(engine, prompt, params, "spec")
        assert spec == plain, f"case {case}: {params}"
        changed += plain != tokens_of(engine, prompt, base, "plain")[0]
        accepted += spec_accepted
    assert changed >= 8, f"the processors changed only {changed} of 12 outputs"
    assert accepted >= 20, f"only {accepted} drafted tokens accepted: the comparison is weak"


def test_min_tokens_holds_off_eos_and_stop_token_ids_stop(engines):
    """min_tokens: a token made an EOS id (the engine's set widened) is not emitted before min_tokens
    output tokens, spec and plain alike; stop_token_ids end the output at that token (it counts,
    as EOS does, and adds no text)."""
    engine = engines("tied_gqa2")
    rng = random.Random(4)
    prompt = random_prompt(rng, len(engine.tokenizer), 20)
    free, _, _ = tokens_of(engine, prompt, SamplingParams(max_tokens=40, ignore_eos=True), "plain")
    stop_token = free[5]
    first = free.index(stop_token)
    for mode in ("plain", "spec"):
        got, reason, _ = tokens_of(engine, prompt, SamplingParams(max_tokens=40, stop_token_ids=(stop_token,)), mode)
        assert reason == "stop" and got == free[: first + 1]
    original = engine.eos_token_ids
    engine.eos_token_ids = original | {stop_token}
    try:
        outs = [tokens_of(engine, prompt, SamplingParams(max_tokens=40, min_tokens=first + 3), mode) for mode in ("plain", "spec")]
    finally:
        engine.eos_token_ids = original
    assert outs[0][0] == outs[1][0]
    assert stop_token not in outs[0][0][: first + 3] and outs[0][0][:first] == free[:first]
