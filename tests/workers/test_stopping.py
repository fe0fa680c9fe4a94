"""OutputStream: exact stops at EOS, stop strings and max_tokens when one step appends several tokens.

Every streamed run is checked against a brute-force reference that decodes each output prefix in
full, over all stop-string offsets, step sizes 1..6 (accepted draft tokens + bonus token) and
max_tokens values.
"""

from __future__ import annotations

import random

import pytest
from tiny_tokenizer import make_tiny_tokenizer

from workers.sampling_params import SamplingParams
from workers.stopping import REPLACEMENT_CHAR, OutputStream, TokenDelta

STEP_SIZES = range(1, 7)
WORDS = (
    *("héllo", "wörld", "日本語", "😀", "the", "fox", "ü€", "𝄞"),
    *("naïve", "café", "🚀", "Paris", ",", "."),
)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def token_ids(tokenizer):
    """A fixed random text of ~30 tokens whose multi-byte characters span several tokens."""
    rng = random.Random(4)
    text = " ".join(rng.choice(WORDS) for _ in range(10))
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids), "no split character"
    return ids


def steps(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def run(tokenizer, ids, params, step_size, eos=frozenset()) -> tuple[OutputStream, list[TokenDelta]]:
    """Feed ``ids`` in steps of ``step_size`` until finished; flush if the tokens run out first."""
    stream = OutputStream(tokenizer, params, set(eos))
    deltas = []
    for step in steps(ids, step_size):
        deltas.append(stream.append(step))
        if deltas[-1].finished:
            return stream, deltas
    deltas.append(stream.flush())
    return stream, deltas


_decoded: dict[tuple[int, ...], str] = {}


def decode(tokenizer, ids: list[int]) -> str:
    """Full decode of the tiny tokenizer, memoised (the reference decodes the same prefixes often)."""
    key = tuple(ids)
    if key not in _decoded:
        _decoded[key] = tokenizer.decode(ids, skip_special_tokens=True)
    return _decoded[key]


def safe_text(tokenizer, ids, stops) -> str:
    """What may be streamed after ``ids``: complete characters, minus a suffix that may start a stop."""
    text = decode(tokenizer, ids).rstrip(REPLACEMENT_CHAR)
    held = [n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])]
    return text[: len(text) - max(held, default=0)]


def reference(tokenizer, ids, params, eos=frozenset()) -> tuple[list[int], str, str]:
    """Output ids, text and finish reason by decoding every prefix in full (flush = "length")."""
    out: list[int] = []
    for token_id in ids:
        out.append(token_id)
        if token_id in eos and not params.ignore_eos:
            return out, decode(tokenizer, out[:-1]), "stop"
        text = decode(tokenizer, out)
        starts = [text.find(s) for s in params.stop if s and s in text]
        if starts:
            return out, text[: min(starts)], "stop"
        if len(out) == params.max_tokens:
            return out, text, "length"
    return out, decode(tokenizer, out), "length"


def check(tokenizer, ids, params, step_size, eos=frozenset(), valid_utf8=True) -> None:
    stream, deltas = run(tokenizer, ids, params, step_size, eos)
    want_ids, want_text, want_reason = reference(tokenizer, ids, params, eos)
    emitted = "".join(d.text for d in deltas)
    assert emitted == stream.text == want_text
    assert stream.token_ids == [t for d in deltas for t in d.token_ids] == want_ids
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].finish_reason == stream.finish_reason == want_reason
    assert all(d.finish_reason is None for d in deltas[:-1])
    sent, consumed = 0, []
    for delta in deltas:
        sent += len(delta.text)
        consumed += delta.token_ids
        assert want_text.startswith(emitted[:sent])
        if valid_utf8 and not delta.finished:
            assert REPLACEMENT_CHAR not in delta.text
            assert emitted[:sent] == safe_text(tokenizer, consumed, params.stop), "withheld too much"


def stop_strings(text: str) -> list[str]:
    """Substrings of ``text`` at every offset and several lengths, plus never-completed prefixes."""
    found = []
    for start in range(len(text)):
        for length in (1, 2, 3, 6):
            if start + length <= len(text):
                found.append(text[start : start + length])
        found.append(text[start : start + 3] + "\x00")
    return sorted(set(found))


def test_stop_string_every_offset_step_size_and_max_tokens(tokenizer, token_ids):
    text = tokenizer.decode(token_ids)
    for stop in stop_strings(text):
        for max_tokens in range(1, len(token_ids) + 2):
            params = SamplingParams(max_tokens=max_tokens, stop=(stop,))
            for step_size in STEP_SIZES:
                check(tokenizer, token_ids, params, step_size)


def test_max_tokens_every_value_without_stop(tokenizer, token_ids):
    for max_tokens in range(1, len(token_ids) + 2):
        for step_size in STEP_SIZES:
            check(tokenizer, token_ids, SamplingParams(max_tokens=max_tokens), step_size)


def test_several_stop_strings_earliest_occurrence_wins(tokenizer, token_ids):
    text = tokenizer.decode(token_ids)
    rng = random.Random(1)
    for _ in range(150):
        stops = []
        for _ in range(rng.randint(2, 4)):
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randint(1, 8)])
        params = SamplingParams(max_tokens=len(token_ids), stop=tuple(stops))
        for step_size in STEP_SIZES:
            check(tokenizer, token_ids, params, step_size)


def test_eos_at_every_position(tokenizer, token_ids):
    eos = {tokenizer.eos_token_id}
    for position in range(len(token_ids) + 1):
        ids = token_ids[:position] + [tokenizer.eos_token_id] + token_ids[position:]
        for max_tokens in {*range(1, len(ids) + 1, 5), position, position + 1, position + 2} - {0}:
            for ignore_eos in (False, True):
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop=("日本",))
                for step_size in (1, 2, 5):
                    check(tokenizer, ids, params, step_size, eos)


def test_eos_counts_as_token_but_adds_no_text(tokenizer):
    ids = tokenizer.encode("the fox")
    eos = tokenizer.eos_token_id
    stream = OutputStream(tokenizer, SamplingParams(max_tokens=len(ids) + 1), {eos})
    delta = stream.append(ids + [eos] + ids)
    assert delta == TokenDelta("the fox", ids + [eos], True, "stop")
    assert stream.token_ids == ids + [eos]


def test_eos_reaching_max_tokens_is_stop(tokenizer):
    eos = tokenizer.eos_token_id
    stream = OutputStream(tokenizer, SamplingParams(max_tokens=1), {eos})
    assert stream.append([eos]) == TokenDelta("", [eos], True, "stop")


def test_stop_string_spanning_steps_is_withheld_then_cut(tokenizer):
    ids = tokenizer.encode("the quick brown fox")
    assert [tokenizer.decode([i]) for i in ids[4:7]] == [" b", "row", "n"]
    stream = OutputStream(tokenizer, SamplingParams(stop=("k brown",)), set())
    assert stream.append(ids[:5]) == TokenDelta("the quic", ids[:5], False, None)
    assert stream.append(ids[5:]) == TokenDelta("", ids[5:7], True, "stop")
    assert (stream.text, stream.token_ids) == ("the quic", ids[:7])


def test_withheld_stop_prefix_released_when_not_completed(tokenizer):
    ids = tokenizer.encode("the quick")
    assert [tokenizer.decode([i]) for i in ids] == ["t", "he", " qu", "ick"]
    stream = OutputStream(tokenizer, SamplingParams(stop=("the fox",)), set())
    assert [stream.append([i]).text for i in ids] == ["", "", "the qu", "ick"]


def test_split_character_is_withheld_until_complete(tokenizer):
    ids = tokenizer.encode("𝄞!")
    assert len(ids) == 5, "𝄞 must span four byte tokens"
    stream = OutputStream(tokenizer, SamplingParams(), set())
    assert [stream.append([i]).text for i in ids] == ["", "", "", "𝄞", "!"]


def test_length_cut_inside_character_emits_decoded_text(tokenizer):
    ids = tokenizer.encode("a𝄞")
    stream = OutputStream(tokenizer, SamplingParams(max_tokens=len(ids) - 1), set())
    delta = stream.append(ids)
    assert delta.finish_reason == "length"
    assert stream.text == tokenizer.decode(ids[:-1]) and stream.text.endswith(REPLACEMENT_CHAR)


def test_calls_after_finish_return_empty_finished_delta(tokenizer):
    ids = tokenizer.encode("the fox")
    stream = OutputStream(tokenizer, SamplingParams(max_tokens=2), set())
    assert stream.append(ids).finished
    assert stream.append(ids) == TokenDelta("", [], True, "length")
    assert stream.flush() == TokenDelta("", [], True, "length")
    assert stream.token_ids == ids[:2]


def test_flush_finishes_for_length_and_releases_withheld_text(tokenizer):
    ids = tokenizer.encode("the fo")
    stream = OutputStream(tokenizer, SamplingParams(stop=("fox",)), set())
    assert stream.append(ids).text == "the "
    assert stream.flush() == TokenDelta("fo", [], True, "length")
    assert stream.text == "the fo"


def test_empty_stop_string_is_ignored(tokenizer):
    ids = tokenizer.encode("the fox")
    stream, deltas = run(tokenizer, ids, SamplingParams(stop=("",)), 2)
    assert stream.text == "the fox" and deltas[-1].finish_reason == "length"


def test_random_token_ids_match_full_decode(tokenizer):
    """Arbitrary ids (invalid UTF-8, special tokens mid-output) still give the exact full decode."""
    rng = random.Random(2)
    vocab = len(tokenizer)
    eos = {tokenizer.eos_token_id}
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        start = rng.randrange(len(text)) if text else 0
        stop = text[start : start + rng.randint(1, 4)].replace(REPLACEMENT_CHAR, "")
        params = SamplingParams(max_tokens=rng.randint(1, 32), stop=(stop,), ignore_eos=rng.random() < 0.5)
        for step_size in STEP_SIZES:
            check(tokenizer, ids, params, step_size, eos, valid_utf8=False)


@pytest.mark.parametrize("step_size", STEP_SIZES)
def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(tokenizer, token_ids, step_size):
    """vLLM's include_stop_str_in_output: the text runs to the end of the earliest stop string (the
    longest complete one starting there), at every offset, whatever the step size; the tokens are
    the same as without it."""
    text = decode(tokenizer, token_ids)
    for start in range(0, len(text) - 3, 3):
        stop = text[start : start + 3]
        if REPLACEMENT_CHAR in stop:
            continue
        with_stop, _ = run(tokenizer, token_ids, SamplingParams(max_tokens=100, stop=(stop, stop[:2]),
                                                                include_stop_str_in_output=True), step_size)
        without, _ = run(tokenizer, token_ids, SamplingParams(max_tokens=100, stop=(stop, stop[:2])), step_size)
        cut = text.find(stop[:2])
        assert without.text == text[:cut]
        # the 2-character stop is complete first; the 3-character one too if the same token completed it
        assert with_stop.text in (text[: cut + 2], text[: cut + 3] if text.startswith(stop, cut) else None)
        assert with_stop.token_ids == without.token_ids
