"""Logprobs, echo and the logits processors over real HTTP (Ray Serve + the real engine on the tiny
model), with the ``openai`` client and raw SSE: speculative and plain decoding answer the same, the
streamed logprobs are the whole response's, and the shapes are OpenAI's (chat) and legacy (completions).
"""

import openai

from test_openai_api import MODEL_NAME, events

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 20,
        "temperature": 0, "ignore_eos": True}
TEXT = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def mode(body: dict, m: str) -> dict:
    return {**body, "rdserve": {"mode": m}}


def test_chat_logprobs_are_the_same_spec_and_plain_and_streamed(http):
    body = {**CHAT, "logprobs": True, "top_logprobs": 3}
    spec, plain = (http.post("/v1/chat/completions", json=mode(body, m)).json() for m in ("spec", "plain"))
    assert spec["rdserve"]["mode"] == "spec" and spec["rdserve"]["accepted_draft_tokens"] > 0
    content = spec["choices"][0]["logprobs"]["content"]
    assert content == plain["choices"][0]["logprobs"]["content"]
    assert len(content) == spec["usage"]["completion_tokens"] == 20
    for entry in content:
        assert len(entry["top_logprobs"]) == 3 and entry["logprob"] <= 0
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # greedy: the most likely token
        assert entry["top_logprobs"][0]["token"] == entry["token"]
    text = bytes(b for e in content for b in e["bytes"]).decode("utf-8", errors="replace")
    assert text == spec["choices"][0]["message"]["content"]
    streamed = [c for c in events(http, "/v1/chat/completions", mode(body, "spec"))[:-1] if c["choices"]]
    assert [e for c in streamed if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]] == content


def test_completions_logprobs_with_echo(http):
    body = {**TEXT, "logprobs": 2, "echo": True}
    whole = http.post("/v1/completions", json=mode(body, "spec")).json()
    choice = whole["choices"][0]
    lp = choice["logprobs"]
    prompt_tokens = whole["usage"]["prompt_tokens"]
    assert choice["text"].startswith(TEXT["prompt"])
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) \
        == prompt_tokens + 12
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first token
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    assert all(len(t) <= 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    plain = http.post("/v1/completions", json=mode(body, "plain")).json()["choices"][0]
    assert plain["logprobs"] == lp and plain["text"] == choice["text"]
    chunks = [c for c in events(http, "/v1/completions", mode(body, "spec"))[:-1] if c["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]] == lp["tokens"]
    without = http.post("/v1/completions", json=mode({**TEXT, "logprobs": 0}, "spec")).json()["choices"][0]
    assert without["logprobs"]["token_logprobs"] == lp["token_logprobs"][prompt_tokens:]
    assert without["logprobs"]["top_logprobs"] == [{}] * 12


def test_vllm_prompt_logprobs(http):
    whole = http.post("/v1/completions", json={**TEXT, "prompt_logprobs": 1}).json()
    entries = whole["choices"][0]["prompt_logprobs"]
    assert len(entries) == whole["usage"]["prompt_tokens"] and entries[0] is None
    for entry in entries[1:]:
        assert 1 <= len(entry) <= 2 and all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())
        assert any(v["rank"] == 1 for v in entry.values())


def test_penalties_and_bias_change_the_output_and_spec_equals_plain(http):
    base = http.post("/v1/completions", json=TEXT).json()["choices"][0]["text"]
    processed = {**TEXT, "presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3,
                 "logit_bias": {"5": 3.0}}
    spec, plain = (http.post("/v1/completions", json=mode(processed, m)).json() for m in ("spec", "plain"))
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"] != base
    for field, value in (("min_tokens", 5), ("stop_token_ids", [0])):  # accepted, and spec equals plain
        spec, plain = (http.post("/v1/completions", json=mode({**TEXT, field: value}, m)).json() for m in ("spec", "plain"))
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"]


def test_openai_client_parses_logprobs(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")
    resp = client.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"], max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 8
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    completion = client.completions.create(model=MODEL_NAME, prompt=TEXT["prompt"], max_tokens=4, temperature=0,
                                           logprobs=1, echo=True)
    assert completion.choices[0].logprobs.token_logprobs[0] is None
    assert completion.choices[0].text.startswith(TEXT["prompt"])
