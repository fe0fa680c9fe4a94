"""``cluster.ingress.protocol``: request validation and the context-length budget."""

import pytest
from pydantic import ValidationError

from cluster.ingress.protocol import (
    DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    fit_kv_cache,
    resolve_max_tokens,
    validation_error,
)

FIELDS = {"prompt_field": "prompt", "max_tokens_field": "max_tokens"}


def test_default_max_tokens_is_remaining_context_capped():
    assert resolve_max_tokens(None, 10, 100, **FIELDS) == 90
    assert resolve_max_tokens(None, 10, 10_000, **FIELDS) == DEFAULT_MAX_TOKENS
    assert resolve_max_tokens(90, 10, 100, **FIELDS) == 90


def test_budget_errors_name_the_field():
    with pytest.raises(RequestError, match="^max_tokens: 91 completion tokens") as err:
        resolve_max_tokens(91, 10, 100, **FIELDS)
    assert err.value.param == "max_tokens"
    with pytest.raises(RequestError, match="^prompt: the prompt has 100 tokens") as err:
        resolve_max_tokens(None, 100, 100, **FIELDS)
    assert err.value.param == "prompt"
    with pytest.raises(RequestError, match="^prompt: the prompt is empty"):
        resolve_max_tokens(None, 0, 100, **FIELDS)


def test_chat_max_completion_tokens_takes_precedence():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=5, max_completion_tokens=7)
    assert (req.requested_max_tokens, req.max_tokens_field) == (7, "max_completion_tokens")


def test_sampling_params_and_extensions():
    req = CompletionRequest(prompt=["hi"], temperature=0, top_k=5, stop="\n", seed=3, rdserve={"mode": "plain"})
    params = req.sampling_params()
    assert req.prompt_text == "hi" and req.requested_mode == "plain"
    assert (params.greedy, params.top_k, params.stop, params.seed) == (True, 5, ("\n",), 3)


def test_text_parts_are_joined_for_the_chat_template():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]}])
    assert req.messages[0].as_template_input() == {"role": "user", "content": "ab"}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "a", "n": 2}, "n"),
        ({"prompt": "a", "temperature": -0.1}, "temperature"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "rdserve": {"mode": "fast"}}, "rdserve"),
        ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "a", "top_logprobs": 1}, "top_logprobs"),
        ({"prompt": "a", "logit_bias": {"42": 101}}, "logit_bias"),
        ({"prompt": "a", "logit_bias": {"-1": 1}}, "logit_bias"),
        ({"prompt": "a", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_invalid_requests_name_the_field(kwargs, field):
    with pytest.raises(ValidationError) as err:
        CompletionRequest(**kwargs)
    assert err.value.errors()[0]["loc"][0] == field


def test_unsupported_fields_are_accepted_with_their_off_values():
    req = CompletionRequest(prompt="a", logprobs=None, echo=False, presence_penalty=0, frequency_penalty=0.0,
                            logit_bias={}, best_of=1, user="someone")
    assert req.sampling_params().temperature == 1.0
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "a"}], logprobs=False,
                                 response_format={"type": "text"}, tool_choice="none", tools=[])
    assert chat.requested_max_tokens is None


def test_kv_cache_budget_names_max_tokens_unless_the_prompt_alone_does_not_fit():
    kv = {"prompt_field": "messages", "max_tokens_field": "max_tokens"}
    assert fit_kv_cache(607, 34, 640, defaulted=False, **kv) == 607  # 34 + 607 - 1 = 640 slots
    with pytest.raises(RequestError) as err:
        fit_kv_cache(700, 34, 640, defaulted=False, **kv)
    assert err.value.param == "max_tokens"
    assert err.value.message == ("max_tokens: 700 completion tokens + 34 prompt tokens need 733 KV cache slots; "
                                 "the cache holds 640 (at most 607 completion tokens with this prompt)")
    assert fit_kv_cache(1024, 34, 640, defaulted=True, **kv) == 607  # a default budget is cut to fit
    with pytest.raises(RequestError, match="^messages: the prompt has 641 tokens; the KV cache holds 640") as err:
        fit_kv_cache(1, 641, 640, defaulted=True, **kv)
    assert err.value.param == "messages"


def rejection(model, body: dict) -> RequestError:
    """The 400 the ingress answers for ``body`` (its ``param`` and message)."""
    with pytest.raises(ValidationError) as err:
        model.model_validate(body)
    return validation_error(err.value.errors())


CHAT = {"messages": [{"role": "user", "content": "a"}]}


@pytest.mark.parametrize(
    "model, body, param, message",
    [
        (CompletionRequest, {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop",
         "stop: at most 4 stop strings are supported, got 5"),
        (CompletionRequest, {"prompt": "a", "stop": ["a", "x" * 257]}, "stop",
         "stop: stop string 1 has 257 characters; at most 256 are supported"),
        (CompletionRequest, {"prompt": "a", "stop": ""}, "stop", "stop: stop string 0 is empty"),
        (CompletionRequest, {"prompt": "a", "stop": 5}, "stop", "stop: must be a string or a list of strings"),
        (CompletionRequest, {"prompt": "a\ud800b"}, "prompt",
         "prompt: invalid text: a lone UTF-16 surrogate (U+D800) at character 1"),
        (CompletionRequest, {"prompt": ["\udfff"]}, "prompt",
         "prompt: invalid text: a lone UTF-16 surrogate (U+DFFF) at character 0"),
        (CompletionRequest, {"prompt": "a", "stop": ["ok", "\ud800"]}, "stop.1",
         "stop.1: invalid text: a lone UTF-16 surrogate (U+D800) at character 0"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content",
         "messages.0.content: invalid text: a lone UTF-16 surrogate (U+D800) at character 0"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
         "messages.0.content.0.text", "messages.0.content.0.text: invalid text: a lone UTF-16 surrogate (U+D800) "
                                      "at character 0"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": None}]}, "messages.0.content",
         "messages.0.content: must be a string or a list of text parts"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages.0.content.0.text", "messages.0.content.0.text: Field required"),
        (CompletionRequest, {"prompt": "a", "n": 2}, "n", "n: only n=1 is supported"),
        (CompletionRequest, {"prompt": ["a", "b"]}, "prompt", "prompt: only a single prompt string is supported"),
        (CompletionRequest, {"prompt": [1, 2, 3]}, "prompt",
         "prompt: token-id prompts (arrays of integers) are not supported; send the prompt text as a string"),
        (CompletionRequest, {"prompt": [[1, 2, 3]]}, "prompt",
         "prompt: token-id prompts (arrays of integers) are not supported; send the prompt text as a string"),
        (CompletionRequest, {"prompt": None}, "prompt", "prompt: must be a string or a list of one string"),
        (ChatCompletionRequest, {**CHAT, "echo": True}, "echo",
         "echo: not supported by this server (accepted only as null or false)"),
        (CompletionRequest, {"prompt": "a", "top_logprobs": 0}, "top_logprobs",
         "top_logprobs: not supported by this server (accepted only as null)"),
        (ChatCompletionRequest, {**CHAT, "logprobs": False, "top_logprobs": 3}, "top_logprobs",
         "top_logprobs: only allowed when logprobs is true"),
        (CompletionRequest, {"prompt": "a", "logit_bias": {"7": -100.5}}, "logit_bias",
         "logit_bias: bias for token 7 is -100.5; biases must lie in [-100, 100]"),
        (CompletionRequest, {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options",
         "stream_options: only allowed when stream is true"),
        (ChatCompletionRequest, {**CHAT, "stream": False, "stream_options": {}}, "stream_options",
         "stream_options: only allowed when stream is true"),
        (CompletionRequest, b"prompt=a", None,
         "body: the request body must be a JSON object, sent with Content-Type: application/json"),
    ],
)
def test_rejections_name_the_field_in_plain_words(model, body, param, message):
    err = rejection(model, body)
    assert (err.param, err.message) == (param, message)


def test_stop_within_the_limits_and_streaming_options_are_accepted():
    req = CompletionRequest(prompt="a", stop=["a", "b", "c", "x" * 256], stream=True, stream_options={})
    assert req.sampling_params().stop == ("a", "b", "c", "x" * 256)
    assert CompletionRequest(prompt="a", stop=[]).sampling_params().stop == ()
    assert ChatCompletionRequest(**CHAT, logprobs=False).sampling_params().stop == ()


# What a client of a vLLM-compatible server sends, each changing what the request means.
VLLM_FIELDS = {
    "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ", "min_p": 0.1, "use_beam_search": True,
    "length_penalty": 0.5, "bad_words": ["x"], "allowed_token_ids": [1, 2], "skip_special_tokens": False,
    "add_generation_prompt": False, "continue_final_message": True, "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": True}, "modalities": ["audio"],
}


@pytest.mark.parametrize("field", sorted(VLLM_FIELDS))
@pytest.mark.parametrize("model, base", [(ChatCompletionRequest, CHAT), (CompletionRequest, {"prompt": "a"})],
                         ids=["chat", "completions"])
def test_fields_that_change_a_request_are_refused_not_ignored(model, base, field):
    err = rejection(model, {**base, field: VLLM_FIELDS[field]})
    assert err.param == field and err.message.startswith(f"{field}: not supported by this server (accepted only as")
    model.model_validate({**base, field: None})  # null: the field is not used


def test_logprobs_penalties_and_vllm_sampling_fields_are_honoured():
    """Each field reaches the engine's sampling parameters (null means off)."""
    chat = ChatCompletionRequest.model_validate({
        **CHAT, "logprobs": True, "top_logprobs": 4, "presence_penalty": 0.5, "frequency_penalty": -1,
        "logit_bias": {"17": -100, "3": 2.5}, "repetition_penalty": 1.3, "min_tokens": 2, "stop_token_ids": [7, 9],
        "prompt_logprobs": 1}).sampling_params()
    assert (chat.logprobs, chat.prompt_logprobs, chat.presence_penalty, chat.frequency_penalty) == (4, 1, 0.5, -1.0)
    assert chat.logit_bias == ((17, -100.0), (3, 2.5)) and chat.stop_token_ids == (7, 9)
    assert (chat.repetition_penalty, chat.min_tokens) == (1.3, 2)
    assert ChatCompletionRequest.model_validate({**CHAT, "logprobs": True}).sampling_params().logprobs == 0
    assert ChatCompletionRequest.model_validate({**CHAT, "logprobs": False}).sampling_params().logprobs is None
    completion = CompletionRequest.model_validate({"prompt": "a", "logprobs": 2, "echo": True}).sampling_params()
    assert (completion.logprobs, completion.prompt_logprobs) == (2, 2)  # echo: the prompt's logprobs too
    assert CompletionRequest.model_validate({"prompt": "a", "echo": True}).sampling_params().prompt_logprobs is None
    nulls = CompletionRequest.model_validate({"prompt": "a", **{f: None for f in (
        "presence_penalty", "frequency_penalty", "logit_bias", "repetition_penalty", "min_tokens", "stop_token_ids",
        "logprobs", "echo", "prompt_logprobs")}}).sampling_params()
    assert not nulls.has_processors and nulls.logprobs is None and nulls.prompt_logprobs is None


@pytest.mark.parametrize("body, field, kind", [
    ({"response_format": {"type": "json_object"}}, "response_format", "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                "strict": True}}}, "response_format", "json_schema"),
    ({"guided_json": {"type": "object"}}, "guided_json", "json_schema"),
    ({"guided_json": '{"type": "object"}'}, "guided_json", "json_schema"),
    ({"guided_regex": "[0-9]+"}, "guided_regex", "regex"),
    ({"guided_choice": ["yes", "no"]}, "guided_choice", "choice"),
    ({"guided_grammar": 'root ::= "a"'}, "guided_grammar", "grammar"),
    ({"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs", "json_schema"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs", "json_object"),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_regex", "regex"),
])
def test_structured_output_fields_set_the_grammar(body, field, kind):
    for model, base in ((ChatCompletionRequest, CHAT), (CompletionRequest, {"prompt": "a"})):
        req = model.model_validate({**base, **body})
        assert req.grammar_field == field and req.sampling_params().grammar.kind == kind


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema"}}, "response_format",
     "response_format: type json_schema needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", None),
    ({"guided_json": '{"type": '}, "guided_json", None),
    ({"guided_choice": []}, "guided_choice", "guided_choice: choice must list at least one string"),
    ({"guided_json": {}, "guided_regex": "a"}, "guided_regex",
     "guided_regex: only one structured-output field may be given; guided_json is too"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "structured_outputs: give exactly one of json, regex, choice, grammar, json_object (got regex, choice)"),
    ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml", None),
    ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos",
     "ignore_eos: cannot be combined with guided_choice: a structured output ends where its grammar does"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "ignore_eos": True}, "ignore_eos", None),
])
def test_bad_structured_output_fields_are_named(body, param, message):
    err = rejection(ChatCompletionRequest, {**CHAT, **body})
    assert err.param == param and (message is None or err.message == message), err.message


def test_vllm_fields_are_accepted_with_their_off_values():
    off = {"repetition_penalty": 1.0, "min_tokens": 0, "stop_token_ids": [], "include_stop_str_in_output": False,
           "min_p": 0.0, "skip_special_tokens": True, "add_generation_prompt": True, "chat_template_kwargs": {},
           "modalities": ["text"]}
    ChatCompletionRequest.model_validate({**CHAT, **off})


def test_two_different_cache_salts_are_refused_naming_the_field():
    """vLLM's top-level ``cache_salt`` and ``rdserve.cache_salt`` mean the same thing: one of them, or
    both equal, is taken; two different values are a 400 on ``cache_salt``, not a silent choice."""
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(messages=msgs, cache_salt="a").sampling_params().cache_salt == "a"
    assert ChatCompletionRequest(messages=msgs, rdserve={"cache_salt": "b"}).sampling_params().cache_salt == "b"
    same = ChatCompletionRequest(messages=msgs, cache_salt="a", rdserve={"cache_salt": "a"})
    assert same.sampling_params().cache_salt == "a"
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest(messages=msgs, cache_salt="a", rdserve={"cache_salt": "b"})
    assert "cache_salt" in str(err.value) and "'a' differs from rdserve.cache_salt 'b'" in str(err.value)
    with pytest.raises(ValidationError, match="differs from rdserve.cache_salt"):
        CompletionRequest(prompt="hi", cache_salt="a", rdserve={"cache_salt": "b"})
