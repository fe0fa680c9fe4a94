"""rdserve's counters against the responses that produced them, on the session's real Ray cluster.

Traffic to the ``/obs`` app (model ``tiny-obs``): greedy speculative and plain requests, streamed
and not, one cut by a stop string, one rejected; the series are read through ``GET /metrics`` on
the HTTP port (the proxy of Ray's metrics agent) until they settle.
"""

import json

import httpx
import pytest
from conftest import OBS_MODEL
from obs_helpers import settled, value

M = "ray_rdserve_"
PROMPTS = ["The quick brown fox", "Once upon a time", "In a galaxy far away", "def fibonacci(n):",
           "The capital of France is", "Rain falls on"]


def complete(http: httpx.Client, prompt: str, mode: str, max_tokens: int = 40, stream: bool = False, **extra) -> dict:
    """One completion; returns ``usage`` plus ``rdserve`` stats and the text."""
    body = {"model": OBS_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "rdserve": {"mode": mode}, "stream": stream, **extra}
    if not stream:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        return {**data["usage"], **data["rdserve"], "text": data["choices"][0]["text"],
                "finish_reason": data["choices"][0]["finish_reason"]}
    body["stream_options"] = {"include_usage": True}
    out, text = {}, []
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                text.append(c["text"])
                if c.get("finish_reason"):
                    out["finish_reason"] = c["finish_reason"]
            out.update(chunk.get("rdserve") or {})
            out.update(chunk.get("usage") or {})
    return {**out, "text": "".join(text)}


@pytest.fixture(scope="module")
def traffic(obs_url):
    """Counters before/after a single speculative request, then before/after mixed traffic."""
    with httpx.Client(base_url=obs_url, timeout=120) as http:
        before_one = settled(obs_url, OBS_MODEL)
        one = complete(http, PROMPTS[0], "spec", max_tokens=48)
        after_one = settled(obs_url, OBS_MODEL, lambda s: value(s, M + "generation_tokens_total")
                            - value(before_one, M + "generation_tokens_total") >= one["completion_tokens"])
        full = complete(http, PROMPTS[1], "spec")
        words = full["text"].split()
        stop = " ".join(words[len(words) // 2: len(words) // 2 + 1]) if len(words) > 2 else full["text"][10:14]
        responses = [full, complete(http, PROMPTS[1], "spec", stop=[stop])]
        responses += [complete(http, p, "spec", stream=i % 2 == 0) for i, p in enumerate(PROMPTS[2:])]
        responses += [complete(http, p, "plain", max_tokens=24, stream=i % 2 == 1) for i, p in enumerate(PROMPTS[:3])]
        bad = http.post("/v1/completions", json={"model": OBS_MODEL, "prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400
        expected = sum(r["completion_tokens"] for r in responses)
        failures = value(after_one, M + "request_failure_total", status=400)
        after = settled(obs_url, OBS_MODEL, lambda s: value(s, M + "generation_tokens_total")
                        - value(after_one, M + "generation_tokens_total") >= expected
                        and value(s, M + "request_failure_total", status=400) > failures)
    return {"before_one": before_one, "one": one, "after_one": after_one, "responses": responses, "after": after,
            "full": full, "stopped": responses[1]}


def delta(traffic, name: str, **labels) -> float:
    """Change of ``name`` over the mixed traffic."""
    return value(traffic["after"], M + name, **labels) - value(traffic["after_one"], M + name, **labels)


def delta_one(traffic, name: str) -> float:
    """Change of ``name`` over the single request."""
    return value(traffic["after_one"], M + name) - value(traffic["before_one"], M + name)


def test_generation_and_prompt_tokens_equal_the_responses_usage(traffic):
    responses = traffic["responses"]
    assert delta(traffic, "generation_tokens_total") == sum(r["completion_tokens"] for r in responses)
    assert delta(traffic, "prompt_tokens_total") == sum(r["prompt_tokens"] for r in responses)


def test_nothing_is_counted_after_a_stop_string(traffic):
    full, stopped = traffic["full"], traffic["stopped"]
    assert stopped["finish_reason"] == "stop" and stopped["completion_tokens"] < full["completion_tokens"]
    # the truncated response's tokens are what the counters hold (the equality above), and its accepted
    # draft tokens are those it emitted:
    accepted = sum(r["accepted_draft_tokens"] for r in traffic["responses"])
    assert delta(traffic, "spec_decode_num_accepted_tokens_total") == accepted


def test_accepted_never_exceed_draft_tokens_and_per_position_is_non_increasing(traffic):
    accepted = delta(traffic, "spec_decode_num_accepted_tokens_total")
    drafted = delta(traffic, "spec_decode_num_draft_tokens_total")
    drafts = delta(traffic, "spec_decode_num_drafts_total")
    assert 0 < accepted <= drafted and 0 < drafts  # the self-distilled drafter is often accepted
    # positions past draft_len_per_beam are reached through the prompt-lookup beam (engine.prompt_lookup_*)
    per_pos = [delta(traffic, "spec_decode_num_accepted_tokens_per_pos_total", position=i) for i in range(33)]
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= drafts
    assert sum(per_pos) == accepted


def test_tokens_per_step_from_counters_equals_the_responses(traffic):
    one = traffic["one"]
    a = delta_one(traffic, "spec_decode_num_accepted_tokens_total")
    steps = delta_one(traffic, "generation_steps_total")
    drafts = delta_one(traffic, "spec_decode_num_drafts_total")
    assert steps == one["num_steps"] and (a + steps) / steps == pytest.approx(one["tokens_per_step"], abs=5e-5)
    # vLLM's mean acceptance length counts drafting steps only: a request's last step is plain when one
    # token is left (nothing to draft), so it is 1 + a / drafts with drafts in [steps - 1, steps]
    assert steps - 1 <= drafts <= steps
    responses = traffic["responses"]
    steps_all = delta(traffic, "generation_steps_total")
    assert steps_all == sum(r["num_steps"] for r in responses)
    weighted = sum(r["tokens_per_step"] * r["num_steps"] for r in responses) / steps_all
    accepted = delta(traffic, "spec_decode_num_accepted_tokens_total")
    assert (accepted + steps_all) / steps_all == pytest.approx(weighted, abs=1e-4)


def test_requests_decisions_and_failures_are_counted(traffic):
    responses = traffic["responses"]
    for reason in ("stop", "length"):
        count = sum(r["finish_reason"] == reason for r in responses)
        assert delta(traffic, "request_success_total", finished_reason=reason) == count
    for mode in ("spec", "plain"):
        count = sum(r["mode"] == mode for r in responses)
        assert delta(traffic, "router_decisions_total", mode=mode, reason="requested") == count
    assert delta(traffic, "request_failure_total", status=400) == 1
    assert delta(traffic, "time_to_first_token_seconds_count") == len(responses)
    assert delta(traffic, "e2e_request_latency_seconds_count") == len(responses)
    assert delta(traffic, "request_queue_time_seconds_count") == len(responses)
    assert delta(traffic, "iteration_seconds_count", kind="spec") > 0

