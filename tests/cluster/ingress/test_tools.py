"""Tool calling pieces without a server: the prompt's generic tool format, the tool-call grammar (real
xgrammar on a byte-level tokenizer), and parsing replies into ``tool_calls`` without losing text."""

import json

import pytest

from cluster.ingress.protocol import ChatCompletionRequest
from cluster.ingress.tools import ToolCallStream, parse_tool_calls, tool_grammar
from workers.models.tool_prompt import render_generic

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_parse_keeps_every_character_that_is_not_a_parsed_call():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\nnot json\n</tool_call> and <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert [c["index"] for c in calls] == [0, 1] and calls[0]["id"] != calls[1]["id"]
    assert content == "Let me check.\n\n<tool_call>\nnot json\n</tool_call> and"
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    assert parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')[0] is None
    unclosed = 'x <tool_call>\n{"name": "f", "argu'
    assert parse_tool_calls(unclosed) == (unclosed, [])  # cut by max_tokens: stays text


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 11])
def test_streaming_split_anywhere_gives_the_same_content_and_calls(cut):
    text = ('A <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call> B <tool_c'
            'all>\n{"name": "get_time", "arguments": {}}\n</tool_call> <tool')
    stream, content, calls = ToolCallStream(), "", []
    for i in range(0, len(text), cut):
        piece, done = stream.feed(text[i: i + cut])
        content += piece
        calls += done
    content += stream.finish()[0]
    whole_content, whole_calls = parse_tool_calls(text)
    assert content.strip() == whole_content
    assert [(c["function"], c["index"]) for c in calls] == [(c["function"], c["index"]) for c in whole_calls]


def test_generic_prompt_format_renders_tools_calls_and_results():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]
    out = render_generic(messages, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n") and json.dumps(WEATHER) in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    with pytest.raises(ValueError, match="message 1: a tool call's function.arguments is not a JSON object"):
        render_generic([messages[1], {**messages[2], "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}], None)


@pytest.fixture(scope="module")
def compiler():
    from workers.models.pull import default_model_dir, is_complete

    if not is_complete(default_model_dir()):
        pytest.skip("needs the default model pulled (`rdserve model pull`; `make test` pulls it first)")
    from workers.models.tokenizer import load_tokenizer
    from workers.structured.compiler import GrammarCompiler

    tokenizer = load_tokenizer(default_model_dir())
    return tokenizer, GrammarCompiler(tokenizer, len(tokenizer))


def accepts(compiler, spec, text: str, complete: bool = True) -> bool:
    from workers.structured.matcher import RequestGrammar

    tokenizer, c = compiler
    grammar = RequestGrammar(c.compile(spec))
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not grammar.allowed()[token]:
            return False
        grammar.advance([token])
    return grammar.allowed()[tokenizer.eos_token_id].item() if complete else True


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_grammar_auto_required_named_and_single(compiler):
    auto = tool_grammar([WEATHER, TIME], "auto", parallel=True)
    assert accepts(compiler, auto, "It is sunny.")  # free text
    assert accepts(compiler, auto, "Checking. " + CALL)
    assert not accepts(compiler, auto, '<tool_call>\n{"name": "get_moon", ', complete=False)  # not a tool
    assert not accepts(compiler, auto, '<tool_call>\n{"name": "get_weather", "arguments": {"town": ', complete=False)
    required = tool_grammar([WEATHER, TIME], "required", parallel=True)
    assert not accepts(compiler, required, "It is", complete=False)  # a call must come first
    assert accepts(compiler, required, CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not accepts(compiler, required, CALL + " and some text", complete=False)  # calls only, then EOS
    named = tool_grammar([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, parallel=True)
    assert not accepts(compiler, named, '<tool_call>\n{"name": "get_w', complete=False)
    assert accepts(compiler, named, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not accepts(compiler, named, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
                       complete=False)
    single = tool_grammar([WEATHER], "required", parallel=False)
    assert accepts(compiler, single, CALL) and not accepts(compiler, single, CALL + "<tool_call>", complete=False)


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
])
def test_bad_tool_requests_name_the_field(body, param):
    from pydantic import ValidationError

    from cluster.ingress.protocol import validation_error

    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
    assert validation_error(err.value.errors()).param == param


def test_tool_choice_none_leaves_tools_out_and_response_format_allowed():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                                                "tool_choice": "none", "response_format": {"type": "json_object"}})
    assert not req.uses_tools and req.tool_dicts is None and req.grammar_field == "response_format"
