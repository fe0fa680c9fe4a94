"""Structured outputs over real HTTP (Ray Serve + the real engine on the tiny model): every
structured-output field constrains the text, speculative and plain decoding answer the same, a stream
carries the same text, and a grammar that does not compile is a 400 naming its field."""

import json
import re

import pytest

from test_openai_api import MODEL_NAME, events

# the random tiny model pads JSON with whitespace (up to 32 characters between tokens): room for it
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 200,
        "temperature": 0}
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": ["integer", "null"]}},
          "required": ["kind"]}


def content(resp: dict) -> str:
    return resp["choices"][0]["message"]["content"]


@pytest.mark.parametrize("field, value, check, bounded", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}},
     lambda t: json.loads(t)["kind"] in ("cat", "dog"), True),
    ("response_format", {"type": "json_object"}, lambda t: isinstance(json.loads(t), dict), False),
    ("guided_regex", "[a-c]{2,5}-[0-9]{2}", lambda t: re.fullmatch("[a-c]{2,5}-[0-9]{2}", t), True),
    ("guided_choice", ["red", "green", "blue"], lambda t: t in ("red", "green", "blue"), True),
    ("structured_outputs", {"grammar": 'root ::= "<" [0-9]{1,4} ">"'}, lambda t: re.fullmatch("<[0-9]+>", t), True),
])
def test_each_structured_output_field_constrains_spec_and_plain_alike(http, field, value, check, bounded):
    """Bounded grammars complete within max_tokens and EOS is then the only choice ("stop"); any JSON
    object may go on (the random model writes long keys), so it is checked only when it completes."""
    body = {**CHAT, field: value}
    spec, plain = (http.post("/v1/chat/completions", json={**body, "rdserve": {"mode": m}}).json() for m in ("spec", "plain"))
    assert content(spec) == content(plain)
    finish = spec["choices"][0]["finish_reason"]
    assert finish == "stop" or not bounded, content(spec)
    assert finish == "length" or check(content(spec)), content(spec)
    streamed = events(http, "/v1/chat/completions", {**body, "rdserve": {"mode": "spec"}})
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed[:-1] if c["choices"]) == content(spec)


def test_completions_take_vllm_guided_fields(http):
    resp = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Pick:", "max_tokens": 10, "temperature": 0,
                                              "guided_choice": ["yes", "no"]}).json()
    assert resp["choices"][0]["text"] in ("yes", "no") and resp["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "a"}}}),
    ("guided_grammar", "root ::= undefined_rule"),
])
def test_a_grammar_that_does_not_compile_is_a_400_naming_its_field(http, field, value):
    resp = http.post("/v1/chat/completions", json={**CHAT, field: value})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}: "), error
