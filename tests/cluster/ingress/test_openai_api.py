"""The served OpenAI API over real HTTP: Ray Serve + the real Engine on the tiny model; the ingress's
handling of a stream's end with stub engine streams, without Ray."""

import asyncio
import json

import httpx
import openai
import pytest

MODEL_NAME = "tiny-llama"  # as in conftest.tiny_config_path
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}]})
TEXT = ("/v1/completions", {"prompt": "Once upon a time"})


def events(client: httpx.Client, path: str, body: dict) -> list[dict | str]:
    """POST with ``stream: true``; the parsed ``data:`` payloads (``"[DONE]"`` kept as a string)."""
    out = []
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def text_of(kind_path: str, choice: dict, streamed: bool) -> str:
    if kind_path == "/v1/completions":
        return choice["text"]
    return (choice["delta"] if streamed else choice["message"]).get("content") or ""


def test_health_and_models(http, tiny_config):
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL_NAME and health["speculative_available"]
    kv = health["kv_cache"]
    assert kv["tokens"] == kv["blocks"] * kv["tokens_per_block"] and 0 <= kv["free_blocks"] <= kv["blocks"]
    assert kv["dtype"] == ("float32" if tiny_config.engine.kv_cache_dtype == "auto" else tiny_config.engine.kv_cache_dtype)
    from workers.compute_path import check_compute_path_name

    assert check_compute_path_name(health["compute_path"]) and health["spec_max_load"] >= 0  # the compute path, its threshold
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL_NAME]
    model = http.get(f"/v1/models/{MODEL_NAME}").json()
    assert model == models["data"][0]
    resp = http.get("/v1/models/gpt-4o")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path, body", [CHAT, TEXT])
def test_stream_agrees_with_non_stream(http, path, body):
    body = {**body, "model": MODEL_NAME, "max_tokens": 24, "temperature": 0}
    whole = http.post(path, json=body).json()
    chunks = events(http, path, {**body, "stream_options": {"include_usage": True}})

    assert chunks[-1] == "[DONE]"
    data = chunks[:-1]
    usage_chunk = data[-1]
    # the same counts; the stream, sent second, found the prompt's full blocks in the prefix cache
    streamed_cached = usage_chunk["usage"].pop("prompt_tokens_details")["cached_tokens"]
    whole_cached = whole["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    blocks = (whole["usage"]["prompt_tokens"] - 1) // 16 * 16  # the tiny config's 16-token blocks
    assert streamed_cached == blocks and whole_cached in (0, blocks)
    choices = [c["choices"][0] for c in data[:-1]]
    finishing = [c for c in choices if c["finish_reason"] is not None]
    assert len(finishing) == 1 and choices[-1] is finishing[0]
    assert finishing[0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    streamed_text = "".join(text_of(path, c, streamed=True) for c in choices)
    assert streamed_text == text_of(path, whole["choices"][0], streamed=False)
    assert data[-2]["rdserve"] == {**whole["rdserve"]}
    if path == "/v1/chat/completions":
        assert choices[0]["delta"]["role"] == "assistant"
        assert whole["object"] == "chat.completion" and data[0]["object"] == "chat.completion.chunk"
    usage = whole["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0


def test_openai_client_chat_and_completions(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=12, temperature=0, seed=1)
    assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
    assert chat.usage.completion_tokens <= 12 and chat.model_extra["rdserve"]["mode"] == "spec"

    text = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=12, temperature=0)
    stream = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text.choices[0].text
    assert chunks[-1].usage == text.usage

    chat_stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=12, temperature=0, seed=1, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat_stream) == chat.choices[0].message.content


def test_sampled_request_with_top_k_and_stop(http):
    body = {"prompt": "Once", "max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7,
            "stop": ["zz"]}
    first = http.post("/v1/completions", json=body).json()
    assert first["choices"][0]["finish_reason"] in ("stop", "length")
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == first["choices"][0]["text"]


@pytest.mark.parametrize("mode", ["spec", "plain"])
def test_forced_mode_is_reported(http, mode):
    for path, body in (CHAT, TEXT):
        # greedy, so the output (and whether it stops at its first token) is deterministic
        resp = http.post(path, json={**body, "max_tokens": 16, "temperature": 0, "rdserve": {"mode": mode}}).json()
        assert resp["rdserve"]["mode"] == mode and resp["rdserve"]["reason"] == f"requested {mode}"
        assert resp["usage"]["completion_tokens"] > 1
        assert resp["rdserve"]["num_steps"] >= 1
        if mode == "plain":
            assert resp["rdserve"]["accepted_draft_tokens"] == 0 and resp["rdserve"]["tokens_per_step"] == 1.0


def test_auto_mode_follows_spec_max_load(http):
    body = {**TEXT[1], "max_tokens": 8}
    speculative = http.post("/v1/completions", json=body).json()["rdserve"]
    assert speculative["mode"] == "spec" and speculative["reason"] == "auto: load 1 <= spec_max_load 64"
    plain = http.post("/auto0/v1/completions", json=body).json()["rdserve"]
    assert plain["mode"] == "plain" and plain["reason"] == "auto: load 1 > spec_max_load 0"
    forced = http.post("/auto0/v1/completions", json={**body, "rdserve": {"mode": "spec"}}).json()["rdserve"]
    assert forced["mode"] == "spec"


LONG = "x" * 2000  # beyond the tiny model's context (max_seq_len 256; 1024 positions at most)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
        ("/v1/completions", {"prompt": LONG}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 256}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 10_000},
         "max_completion_tokens"),
        ("/v1/completions", {"prompt": "a", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "a", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "a", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "a", "n": 2}, "n"),
        ("/v1/completions", {"prompt": "a", "rdserve": {"mode": "fast"}}, "rdserve.mode"),
        ("/v1/completions", {"prompt": "a", "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "a", "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                  "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
         "response_format"),
        ("/v1/completions", {"prompt": "a", "guided_regex": "[a-"}, "guided_regex"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
         "tools.0.function"),
        ("/v1/completions", {"prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "a", "stop_token_ids": [99999999]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "a", "stop": ["x" * 4096] * 250}, "stop"),
        ("/v1/completions", {"prompt": "a", "stop": ""}, "stop"),
        ("/v1/completions", {"prompt": "a\ud800"}, "prompt"),
        ("/v1/completions", {"prompt": "a", "stop": ["\ud800"]}, "stop.0"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ],
)
def test_bad_requests_are_400_naming_the_field(http, path, body, param):
    for stream in (False, True):  # json.dumps keeps a lone surrogate as the JSON escape "\ud800"
        resp = http.post(path, content=json.dumps({**body, "stream": stream}), headers={"content-type": "application/json"})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] is None
        assert error["message"].startswith(f"{param}:") and "Value error" not in error["message"]


def test_stream_options_need_stream_and_a_body_must_be_json(http):
    resp = http.post("/v1/completions", json={"prompt": "a", "stream_options": {"include_usage": True}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream_options"
    resp = http.post("/v1/completions", content=b"prompt=a", headers={"content-type": "text/plain"})
    assert resp.status_code == 400 and "Content-Type: application/json" in resp.json()["error"]["message"]


def test_malformed_json_unknown_paths_and_huge_prompts_get_openai_errors(http):
    resp = http.post("/v1/completions", content=b'{"prompt": "a",', headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] is None and resp.json()["error"]["message"].startswith("body: invalid JSON")
    for method, path, code in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        resp = http.request(method, path)
        assert resp.status_code == code and "message" in resp.json()["error"]
    resp = http.post("/v1/completions", json={"prompt": "x" * 2_000_000, "max_tokens": 4})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"  # over the body cap
    resp = http.post("/v1/completions", json={"prompt": "x" * 900_000, "max_tokens": 4})  # under it, too long
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    assert "characters cannot fit" in resp.json()["error"]["message"]


def test_completions_null_max_tokens_means_the_default_16(http):
    body = {"prompt": "Once upon a time", "temperature": 0, "max_tokens": None, "stop": None}
    usage = http.post("/v1/completions", json={**body, "ignore_eos": True}).json()["usage"]
    assert usage["completion_tokens"] == 16


def test_openai_client_sees_400(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL_NAME, prompt="a", temperature=-1)


def test_concurrent_requests_all_complete(base_url):
    import asyncio

    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            bodies = [{"prompt": f"request {i}", "max_tokens": 16} for i in range(4)]
            resps = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
        return [r.json() for r in resps]

    for resp in asyncio.run(run()):
        assert resp["choices"][0]["finish_reason"] in ("stop", "length")
        assert resp["rdserve"]["reason"].startswith("auto: load ")


def test_client_disconnect_releases_the_replica(http):
    with http.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 200, "stream": True}) as resp:
        next(resp.iter_lines())
    for _ in range(50):
        if http.get("/health").json()["load"] == 0:
            break
    assert http.get("/health").json()["load"] == 0
    assert http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4}).status_code == 200


class EndsLate:
    """A stub engine stream: ``items``, then its end ``end_after_s`` later (with an engine deployment the
    end is its own Ray message), or never (None)."""

    def __init__(self, items: list, end_after_s: float | None):
        self.items, self.end_after_s = list(items), end_after_s
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.end_after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.end_after_s)
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class StubClient:
    """An engine client whose one stream is ``stream``, counted as a pool counts it (``TrackedStream``)."""

    def __init__(self, stream: EndsLate):
        self.inner, self.done = stream, 0

    def stream(self, _request):
        from cluster.ingress.pools import TrackedStream

        return TrackedStream(self.inner, self.count_done)

    def count_done(self) -> None:
        self.done += 1


def final_delta(text: str = "hi"):
    from workers.outputs import GenerationDelta

    return GenerationDelta(text=text, token_ids=[1], finished=True, finish_reason="stop", prompt_tokens=3,
                           completion_tokens=1, num_steps=1, accepted_draft_tokens=0)


def stub_ingress(client: StubClient, timeout_s: float | None):
    """The ingress class, without Serve, on ``client`` with ``serve.request_timeout_s`` ``timeout_s``."""
    from cluster.ingress.drain import Admission
    from cluster.ingress.openai_api import OpenAIIngress

    bare = type("BareIngress", (OpenAIIngress.func_or_class,), {"__del__": lambda self: None})  # no ASGI app to close
    ingress = object.__new__(bare)
    ingress.engine, ingress.pool_load, ingress.model_name = client, None, MODEL_NAME
    ingress.admission = Admission(timeout_s)
    return ingress


async def answer(ingress, stream: bool) -> tuple[int, list]:
    """POST /v1/completions on the stub ingress: the status and the JSON body (or the SSE data lines)."""
    from cluster.ingress.protocol import CompletionRequest

    resp = await ingress.completions(CompletionRequest(prompt="a", stream=stream))
    if not stream:
        return resp.status_code, [json.loads(resp.body)]
    return resp.status_code, [chunk async for chunk in resp.body_iterator]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_final_item_is_in_hand_is_not_timed_out_by_its_stream_end(stream):
    """The final item arrives at once, the stream's end 0.1 s later, past the 0.05 s deadline."""
    from cluster.ingress.messages import Started

    client = StubClient(EndsLate([Started(3, "plain", "requested plain", "local"), final_delta()], 0.1))
    status, body = asyncio.run(answer(stub_ingress(client, timeout_s=0.05), stream))
    assert status == 200, body
    if stream:
        assert body[-1] == "data: [DONE]\n\n" and not any('"error"' in line for line in body)
        assert json.loads(body[-2][len("data: "):])["choices"][0]["finish_reason"] == "stop"
    else:
        assert body[0]["choices"][0]["text"] == "hi"
    assert client.done == 1 and not client.inner.cancelled  # it ended by itself, counted out once


@pytest.mark.parametrize("stream", [False, True])
def test_a_stream_that_does_not_end_after_its_final_item_is_cancelled(stream, monkeypatch):
    from cluster.ingress import openai_api
    from cluster.ingress.messages import Failed, Started

    monkeypatch.setattr(openai_api, "STREAM_END_GRACE_S", 0.05)
    client = StubClient(EndsLate([Started(3, "plain", "requested plain", "local"), final_delta()], None))
    status, body = asyncio.run(answer(stub_ingress(client, timeout_s=None), stream))
    assert status == 200 and client.done == 1 and client.inner.cancelled
    assert (body[-1] == "data: [DONE]\n\n") if stream else body[0]["choices"][0]["text"] == "hi"


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_error_is_not_followed_by_a_timeout(stream):
    from cluster.ingress.messages import Failed, Started

    client = StubClient(EndsLate([Started(3, "plain", "requested plain", "local"), Failed(500, "boom")], 0.1))
    status, body = asyncio.run(answer(stub_ingress(client, timeout_s=0.05), stream))
    if stream:  # the engine's error, not a timeout after it
        assert status == 200 and sum('"error"' in line for line in body) == 1 and "boom" in body[-2]
    else:
        assert status == 500 and body[0]["error"]["message"] == "boom"
    assert client.done == 1 and not client.inner.cancelled


def test_retrieve_model_knows_only_the_served_model():
    from cluster.ingress.openai_api import ModelNotFound

    ingress = stub_ingress(StubClient(EndsLate([], 0.0)), timeout_s=None)
    ingress.created = 0
    assert asyncio.run(ingress.model(MODEL_NAME)).id == MODEL_NAME
    with pytest.raises(ModelNotFound, match="'org/other' does not exist"):
        asyncio.run(ingress.model("org/other"))
