"""``cluster.protocol``: request validation and the context-length budget."""

import pytest
from pydantic import ValidationError

from cluster.protocol import (
    DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    resolve_max_tokens,
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
        ({"prompt": "a", "echo": True}, "echo"),
        ({"prompt": "a", "logit_bias": {"42": 5}}, "logit_bias"),
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
