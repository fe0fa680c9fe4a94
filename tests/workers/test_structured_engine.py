"""Constrained decoding in the engine is exact under speculation: at every draft-tree node the
grammar's mask applies to the base model's logits before acceptance, and the matcher moves along the
accepted path only. Greedy constrained speculative output equals greedy constrained plain output
token for token, seeded sampling likewise (keyed draws), and every finished output matches its grammar.
Tiny random models with their own byte-level tokenizer; float32 and GGUF weights.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from test_lossless import random_prompt
from spec_engines import engine_4x4_factory
from tiny_gguf import weights_variant
from workers.sampling_params import SamplingParams
from workers.structured.errors import GrammarError
from workers.structured.spec import GrammarSpec

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": ["integer", "null"]},
    "kind": {"enum": ["cat", "dog", "owl"]}},
    "required": ["kind", "name"]}
SPECS = {
    "json_schema": GrammarSpec.json_schema(SCHEMA),
    "regex": GrammarSpec.regex(r"[a-c]{2,4}-[0-9]{1,3}"),
    "choice": GrammarSpec.choice(["alpha", "beta", "gamma delta"]),
    "grammar": GrammarSpec.grammar('root ::= "(" [xyz]+ ("," [xyz]+)* ")"'),
}


def matches(kind: str, text: str) -> bool:
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(r"[a-c]{2,4}-[0-9]{1,3}", text) is not None
    if kind == "choice":
        return text in ("alpha", "beta", "gamma delta")
    return re.fullmatch(r"\([xyz]+(,[xyz]+)*\)", text) is not None


@pytest.fixture(scope="module")
def engines(tiny_model_dirs, trained_drafter_dirs):
    return engine_4x4_factory(tiny_model_dirs, trained_drafter_dirs)


def generate(engine, prompt, params, mode):
    deltas = list(engine.generate(prompt, params, mode))
    return ([t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas[-1].finish_reason,
            deltas[-1].accepted_draft_tokens)


@pytest.mark.parametrize("weights", ["float32", "gguf"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_constrained_spec_equals_plain_and_matches_the_grammar(engines, weights, sampled):
    engine = engines(weights_variant("tied_sharp" if sampled else "tied_gqa2", weights))
    finished = accepted = 0
    for case in range(12):
        kind = list(SPECS)[case % len(SPECS)]
        rng = random.Random(case)
        prompt = random_prompt(rng, len(engine.tokenizer), 20)
        params = SamplingParams(max_tokens=48, grammar=SPECS[kind], temperature=0.8 if sampled else 0.0,
                                seed=case if sampled else None)
        plain = generate(engine, prompt, params, "plain")
        spec = generate(engine, prompt, params, "spec")
        assert spec[:3] == plain[:3], f"case {case} ({kind})"
        if plain[2] == "stop":
            assert matches(kind, plain[1]), (kind, plain[1])
            finished += 1
        accepted += spec[3]
    assert finished >= 6, f"only {finished} of 12 outputs completed their grammar"
    assert accepted >= 10, f"only {accepted} drafted tokens accepted: the comparison is weak"


@pytest.mark.parametrize("mode", ["plain", "spec"])
def test_min_tokens_does_not_outlast_a_complete_grammar(engines, mode):
    """A choice completes in a few tokens; min_tokens beyond that must not forbid the only allowed
    token (EOS): the request ends "stop" with a valid choice. ignore_eos with a grammar is refused."""
    engine = engines("tied_gqa2")
    tokens, text, reason, _ = generate(engine, [5, 6, 7], SamplingParams(max_tokens=30, min_tokens=20,
                                                                          grammar=SPECS["choice"]), mode)
    assert reason == "stop" and matches("choice", text)
    with pytest.raises(ValueError, match="ignore_eos"):
        engine.add_request("x", [5], SamplingParams(grammar=SPECS["choice"], ignore_eos=True), mode)


def test_a_grammar_that_does_not_compile_is_a_value_error(engines):
    engine = engines("tied_gqa2")
    with pytest.raises(GrammarError, match="cannot compile regex"):
        engine.add_request("bad", [5, 6], SamplingParams(grammar=GrammarSpec.regex("[a-")), "plain")
    assert engine.num_unfinished == 0


def test_grammar_rejected_draft_tokens_are_counted_apart(engines):
    """The engine's stats count draft tokens the grammar forbade separately: some under a schema,
    never more than the draft tokens not accepted, none without a grammar."""
    from workers.engine_metrics import EngineStats

    engine = engines("tied_gqa2")
    engine.stats = EngineStats()
    try:
        for case in range(4):
            prompt = random_prompt(random.Random(case), len(engine.tokenizer), 20)
            list(engine.generate(prompt, SamplingParams(max_tokens=48, grammar=SPECS["json_schema"]), "spec",
                                 force_draft=True))
        constrained = engine.drain_stats()
        for case in range(2):
            list(engine.generate(random_prompt(random.Random(case), len(engine.tokenizer), 20),
                                 SamplingParams(max_tokens=24), "spec", force_draft=True))
        free = engine.drain_stats()
    finally:
        engine.stats = None
    assert 0 < constrained.grammar_rejected_tokens <= constrained.draft_tokens - constrained.accepted_tokens
    assert free.grammar_rejected_tokens == 0 and free.draft_tokens > 0
