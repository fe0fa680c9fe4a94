"""Tool calling over real HTTP (Ray Serve + the real engine on the tiny model): forced calls
(``required``, a named function) are valid calls of the given tools, speculative and plain decoding
answer the same, streamed tool-call deltas add up to the response's calls, and a conversation with
tool results continues.

The tools' prompt (instructions and JSON signatures) is ~800 tokens of the tiny byte-level tokenizer,
beyond the session's tiny app (256): this module deploys its own app with a 1024-token context.
"""

import json

import httpx
import pytest
from ray import serve

from cluster.config import load_config
from cluster.deploy.app import deploy
from test_openai_api import MODEL_NAME, events
from tiny_tokenizer import make_tiny_tokenizer

APP, PREFIX = "tools", "/tools"


@pytest.fixture(scope="module")
def http(base_url, tiny_config_path):
    path = tiny_config_path.parent / "tools.yaml"
    path.write_text(tiny_config_path.read_text().replace("max_seq_len: 256", "max_seq_len: 1024"))
    deploy(load_config(path), name=APP, route_prefix=PREFIX)
    with httpx.Client(base_url=f"{base_url}{PREFIX}", timeout=120) as client:
        yield client
    serve.delete(APP)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer",
                                                                                          "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}

def _whitespace_bias() -> dict[str, float]:
    """-100 on the tiny tokenizer's whitespace tokens: the random model would pad JSON with up to 16
    whitespace characters at every gap the grammar allows them (the grammar still allows them where
    needed: a bias is finite, a mask is not)."""
    tokenizer = make_tiny_tokenizer()
    return {str(i): -100.0 for i in range(len(tokenizer)) if tokenizer.decode([i]).isspace()}


BODY = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "What is the weather?"}], "max_tokens": 200,
        "temperature": 0, "tools": [WEATHER, TIME], "logit_bias": _whitespace_bias()}


def without_ids(message: dict) -> dict:
    """The message with its tool calls' ids (random per response) left out."""
    return {**message, "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in message["tool_calls"] or []]}


def calls_of(resp: dict) -> list[tuple[str, dict]]:
    message = resp["choices"][0]["message"]
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]


@pytest.mark.parametrize("choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_forced_tool_calls_are_valid_and_spec_equals_plain(http, choice, names):
    body = {**BODY, "tool_choice": choice, "parallel_tool_calls": False}
    spec, plain = (http.post("/v1/chat/completions", json={**body, "rdserve": {"mode": m}}).json() for m in ("spec", "plain"))
    assert without_ids(spec["choices"][0]["message"]) == without_ids(plain["choices"][0]["message"])
    calls = calls_of(spec)
    assert len(calls) == 1 and calls[0][0] in names, spec["choices"][0]
    name, args = calls[0]
    if name == "get_weather":
        assert args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 9
    else:
        assert args == {"zone": args["zone"]} and args["zone"] in ("UTC", "CET")
    assert spec["choices"][0]["finish_reason"] == "tool_calls"
    assert spec["choices"][0]["message"]["content"] is None


def test_streamed_tool_call_deltas_add_up_to_the_response(http):
    body = {**BODY, "tool_choice": "required"}
    whole = http.post("/v1/chat/completions", json=body).json()
    chunks = [c for c in events(http, "/v1/chat/completions", body)[:-1] if c["choices"]]
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == calls_of(whole)
    assert [d["index"] for d in deltas] == list(range(len(deltas))) and all(d["id"].startswith("call_") for d in deltas)
    assert deltas and chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    # parallel calls allowed: the random model may go on calling until max_tokens ("length")
    assert whole["choices"][0]["finish_reason"] in ("tool_calls", "length")
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks).strip() == \
        (whole["choices"][0]["message"]["content"] or "")


def test_a_conversation_with_tool_results_continues(http):
    first = http.post("/v1/chat/completions", json={**BODY, "tool_choice": "required", "parallel_tool_calls": False}).json()
    message = first["choices"][0]["message"]
    follow = {**BODY, "messages": BODY["messages"] + [message] + [
        {"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"result": "sunny"})} for c in message["tool_calls"]]}
    resp = http.post("/v1/chat/completions", json={**follow, "tool_choice": "none", "max_tokens": 8})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["tool_calls"] is None, resp.text
    resp = http.post("/v1/chat/completions", json={**follow, "max_tokens": 40})
    assert resp.status_code == 200, resp.text
    auto = resp.json()["choices"][0]
    assert auto["finish_reason"] in ("stop", "length", "tool_calls")  # auto: the model chooses; nothing lost:
    text = auto["message"]["content"] or ""
    assert all(call["function"]["name"] in ("get_weather", "get_time") for call in auto["message"]["tool_calls"] or [])
    assert "<tool_call>" not in text or "</tool_call>" not in text.split("<tool_call>")[-1] or auto["finish_reason"] == "length"


def test_tool_errors_are_400s_naming_the_field(http):
    resp = http.post("/v1/chat/completions", json={**BODY, "tool_choice": {"type": "function", "function": {"name": "x"}}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"
    bad = {**BODY, "messages": [{"role": "tool", "content": "x"}]}
    resp = http.post("/v1/chat/completions", json=bad)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages.0.tool_call_id"
