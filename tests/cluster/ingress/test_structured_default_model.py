"""Structured outputs on the real default model (SmolLM2-135M-Instruct with the committed drafter, the
engine and speculation sections of ``configs/local.yaml``), deployed as its own app on the session's
Ray Serve and called over HTTP with the ``openai`` client, as users call it:

- ``client.chat.completions.parse`` with a Pydantic ``response_format`` returns the parsed object,
  speculative and plain alike;
- requests shaped as in vLLM issue #15554 (a JSON schema with required fields, optional nullable
  fields and an enum): at temperature 0 every answer validates and speculative = plain; at 0.7 with
  a seed every speculative answer validates.

About a minute on 2 cores, most of it loading the model.
"""

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel


pytestmark = pytest.mark.slow

NUM_REQUESTS = 16
CONCURRENCY = 4
MAX_TOKENS = 160
EVENT_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "category": {"enum": ["meeting", "trip", "purchase", "celebration", "other"]},
        "person": {"type": ["string", "null"]},
        "age": {"type": ["integer", "null"]},
        "date": {"type": ["string", "null"]},
        "location": {"type": ["string", "null"]},
        "attendees": {"type": ["integer", "null"]},
    },
    "required": ["title", "category"],
}
PERSONS = ["Maria Lopez", "Tom Becker", "Aiko Tanaka", "Samuel Okafor"]
SENTENCES = ["{p} ({a}) is organizing the budget review in {c} on {d} for {n} colleagues.",
             "{p} will go on a hiking trip near {c} {d}.",
             "On {d}, {p} bought a used bicycle at a market in {c}.",
             "{p} turned {a} and celebrated in {c} with {n} friends."]
CITIES = ["Lisbon", "Osaka", "Lima", "Oslo"]
TEXTS = [SENTENCES[i % 4].format(p=PERSONS[i // 4], a=20 + 3 * i, c=CITIES[(i + i // 4) % 4],
                                 d=["March 3", "next Friday", "2024-05-17"][i % 3], n=2 + 5 * i)
         for i in range(NUM_REQUESTS)]


class City(BaseModel):
    name: str
    country: str
    continent: Literal["Africa", "Asia", "Europe", "North America", "South America", "Oceania"]
    population_millions: float | None


@pytest.mark.parametrize("mode", ["spec", "plain"])
def test_parse_with_a_pydantic_response_format(smollm, mode):
    client, model, _ = smollm
    completion = client.chat.completions.parse(
        model=model, response_format=City, max_tokens=128, temperature=0,
        messages=[{"role": "user", "content": "Describe the city of Paris as JSON: name, country, continent, "
                                              "population in millions."}],
        extra_body={"rdserve": {"mode": mode}})
    message = completion.choices[0].message
    assert isinstance(message.parsed, City), message.content
    assert message.parsed == City.model_validate_json(message.content)
    assert completion.model_extra["rdserve"]["mode"] == mode


def events(client: OpenAI, model: str, mode: str, temperature: float) -> list:
    """The ``TEXTS`` as extraction requests with ``EVENT_SCHEMA``, ``CONCURRENCY`` at a time."""
    def one(i: int):
        return client.chat.completions.create(
            model=model, max_tokens=MAX_TOKENS, temperature=temperature, seed=i if temperature else None,
            messages=[{"role": "user", "content": "Extract the event from the text as JSON; use null for what the "
                                                  f"text does not say.\n\nText: {TEXTS[i]}"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "event", "schema": EVENT_SCHEMA, "strict": True}},
            extra_body={"rdserve": {"mode": mode}})

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(one, range(NUM_REQUESTS)))


def assert_all_valid(completions: list) -> None:
    """Every answer that ended by itself parses and validates; at most 2 of 16 ran to max_tokens (the
    135M model can loop inside a JSON string, "og og og ...", which the grammar allows: a string may be
    long); those are a valid prefix, the grammar having allowed every token."""
    validator = jsonschema.Draft202012Validator(EVENT_SCHEMA)
    cut = [c.choices[0].message.content for c in completions if c.choices[0].finish_reason == "length"]
    assert len(cut) <= 2, cut
    for c in completions:
        if c.choices[0].finish_reason == "stop":
            validator.validate(json.loads(c.choices[0].message.content))


def test_nullable_optional_fields_and_an_enum_greedy_spec_equals_plain(smollm):
    client, model, _ = smollm
    spec, plain = events(client, model, "spec", 0.0), events(client, model, "plain", 0.0)
    assert_all_valid(spec)
    assert [c.choices[0].message.content for c in spec] == [c.choices[0].message.content for c in plain]
    stats = [c.model_extra["rdserve"] for c in spec]
    assert {s["mode"] for s in stats} == {"spec"}
    assert sum(s["accepted_draft_tokens"] for s in stats) > 0  # draft trees under the grammar were accepted


def test_nullable_optional_fields_and_an_enum_sampled_seeded_spec(smollm):
    client, model, _ = smollm
    sampled = events(client, model, "spec", 0.7)
    assert_all_valid(sampled)
    assert {c.model_extra["rdserve"]["mode"] for c in sampled} == {"spec"}
