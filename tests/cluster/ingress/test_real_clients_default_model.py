"""Apps' and agents' clients against the default model over real HTTP, speculative and plain decoding
forced: LangChain's ``ChatOpenAI(...).bind_tools`` and ``.with_structured_output`` (function calling and
json_schema), and the ``openai`` client's tools, tool results and logprobs. Each client's own parsing
is the check: a response it cannot read fails the test."""

import json
from typing import Literal

import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow
MODES = ["spec", "plain"]


@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """Current weather in a city."""
    return json.dumps({"city": city, "temperature": 18, "unit": unit})


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="full name")
    age: int | None = Field(description="age in years, null if not given")
    role: Literal["engineer", "teacher", "doctor", "other"]


def chat(smollm, mode: str, **kwargs) -> ChatOpenAI:
    _, model, url = smollm
    return ChatOpenAI(model=model, base_url=url, api_key="unused", temperature=0, max_tokens=160, max_retries=0,
                      timeout=120, extra_body={"rdserve": {"mode": mode}}, **kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_langchain_bind_tools_forced_and_auto(smollm, mode):
    llm = chat(smollm, mode)
    question = [HumanMessage("What is the weather in Lisbon right now?")]
    forced = llm.bind_tools([get_weather], tool_choice="any").invoke(question)  # "any": OpenAI's required
    assert forced.tool_calls and all(c["name"] == "get_weather" for c in forced.tool_calls)
    call = forced.tool_calls[0]
    assert isinstance(call["args"]["city"], str) and call["args"].get("unit", "celsius") in ("celsius", "fahrenheit")
    result = get_weather.invoke(call["args"])
    answer = llm.bind_tools([get_weather]).invoke(question + [forced, ToolMessage(result, tool_call_id=call["id"])])
    assert answer.content or answer.tool_calls  # auto: the model chose; either way LangChain read it


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
@pytest.mark.parametrize("mode", MODES)
def test_langchain_with_structured_output(smollm, mode, method):
    extractor = chat(smollm, mode).with_structured_output(Person, method=method)
    person = extractor.invoke("Extract the person: Dr. Maria Silva, 41, works as a doctor in Porto.")
    assert isinstance(person, Person) and person.name


def test_greedy_tool_calls_and_logprobs_are_the_same_spec_and_plain(smollm):
    client, model, _ = smollm
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                "parameters": get_weather.args_schema.model_json_schema()}}]
    answers = [client.chat.completions.create(
        model=model, temperature=0, max_tokens=120, tools=tools, tool_choice="required", parallel_tool_calls=False,
        logprobs=True, top_logprobs=2,
        messages=[{"role": "user", "content": "Weather in Oslo and in Lima?"}], extra_body={"rdserve": {"mode": m}})
        for m in MODES]
    spec, plain = (a.choices[0] for a in answers)
    assert [(c.function.name, c.function.arguments) for c in spec.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in plain.message.tool_calls]
    assert spec.finish_reason == plain.finish_reason == "tool_calls"
    assert [(e.token, e.logprob) for e in spec.logprobs.content] == [(e.token, e.logprob) for e in plain.logprobs.content]
    assert answers[0].model_extra["rdserve"]["accepted_draft_tokens"] > 0
