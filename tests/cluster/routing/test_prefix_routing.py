"""Cache-aware ranking as plain functions (``workers.text_prefix``, ``cluster.routing.ranking``):
routing-text hashes, a replica's index and report, and the ranking with fake replicas that hold prefixes."""

import random
from collections import Counter
from dataclasses import replace

import pytest

from cluster.replica.stats import PrefixStats
from cluster.routing.ranking import (PREFILL_TOKEN_UNITS, Candidate, RecentPrefixes, cached_prompt_tokens,
                                     rank_replicas)
from workers.text_prefix import (MAX_REPORTED, TEXT_BLOCK_CHARS, PrefixIndex, cached_chars, routing_text,
                                         text_block_hashes)

SYSTEM = "You are a careful assistant for the ACME support desk. " * 40  # ~2200 characters


def chat(user: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def hashes_of(messages=None, prompt=None, tools=None, salt=None) -> list[int]:
    return text_block_hashes(routing_text(prompt, messages, tools, salt))


def test_hash_chains_cover_the_whole_prefix_and_follow_message_boundaries():
    a, b = hashes_of(chat("first question")), hashes_of(chat("a different question"))
    shared = len(routing_text(None, chat("x"))) // TEXT_BLOCK_CHARS - 1  # blocks inside the system message
    assert shared >= 15 and a[:shared] == b[:shared]
    assert len(a) == len(routing_text(None, chat("first question"))) // TEXT_BLOCK_CHARS  # full blocks only
    # one character changed in the first block changes every hash after it (a chain, not per block)
    other = hashes_of(chat("first question", system="Z" + SYSTEM[1:]))
    assert not set(a) & set(other)
    # a salt, tools or raw prompt vs chat starts another chain
    assert not set(a) & set(hashes_of(chat("first question"), salt="tenant-2"))
    assert not set(a) & set(hashes_of(chat("first question"), tools=[{"type": "function", "function": {"name": "f"}}]))
    assert not set(hashes_of(prompt=SYSTEM)) & set(hashes_of(chat("")))
    # key order inside a message does not matter (canonical JSON)
    assert hashes_of([{"content": SYSTEM, "role": "system"}]) == hashes_of([{"role": "system", "content": SYSTEM}])
    assert hashes_of(prompt="short") == []


def test_cached_chars_is_the_longest_prefix_held():
    h = hashes_of(chat("question"))
    assert cached_chars(h, None) == 0 and cached_chars(h, frozenset()) == 0
    assert cached_chars(h, frozenset(h[:5])) == 5 * TEXT_BLOCK_CHARS
    assert cached_chars(h, {h[7], h[2]}) == 8 * TEXT_BLOCK_CHARS  # a chain hash stands for its prefix
    assert cached_chars(h, set(hashes_of(chat("other", system="Z" * 3000)))) == 0


def test_index_reports_the_most_recent_prefixes_that_fit_the_cache_roots_first():
    index = PrefixIndex(capacity=100)
    old, new = hashes_of(prompt="o" * 128 * 30), hashes_of(prompt="n" * 128 * 30)
    index.add(old)
    index.add(new)
    assert len(index) == 60
    # room for 40 blocks of text: all of the newer prompt, and the first 10 blocks of the older (its
    # tail goes first, as the engine evicts least recently released blocks)
    report = index.report(cached_tokens=40 * TEXT_BLOCK_CHARS // 4, chars_per_token=4.0)
    assert report == frozenset(new) | frozenset(old[:10])
    assert cached_chars(old, report) == 10 * TEXT_BLOCK_CHARS and cached_chars(new, report) == 30 * TEXT_BLOCK_CHARS
    assert index.report(0, 4.0) == frozenset()
    assert len(index.report(10**9, 4.0)) == 60
    index.add(hashes_of(prompt="x" * 128 * 80))  # over capacity: the oldest go
    assert len(index) == 100 and not set(old) & set(index.report(10**9, 4.0))
    big = PrefixIndex()
    big.add(list(range(MAX_REPORTED + 10)))
    assert len(big.report(10**9, 4.0)) == MAX_REPORTED


def test_replica_prefix_stats_learn_characters_per_token():
    prefix = PrefixStats()
    text = routing_text(None, chat("hello"))
    prefix.admitted(text, prompt_tokens=len(text) // 5)
    assert prefix.chars_per_token == pytest.approx(5.0, rel=0.01)
    prefix.admitted(text, prompt_tokens=len(text) // 3)
    assert 3.0 < prefix.chars_per_token < 5.0
    assert cached_chars(hashes_of(chat("hello")), prefix.index.report(10**6, prefix.chars_per_token)) > 0


def stats(load=0, step_s=0.0, prefix=frozenset(), prefill_s_per_token=0.0, chars_per_token=4.0) -> dict:
    return {"load": load, "running": load, "waiting": 0, "free_kv_blocks": 1000, "num_kv_blocks": 1000,
            "tokens_per_block": 16, "kv_usage": 0.0, "max_batch_size": 16, "step_s": step_s, "tau": 1.0,
            "shape": "plain", "ttft_p90_s": None, "prefix_hashes": prefix,
            "prefill_s_per_token": prefill_s_per_token, "chars_per_token": chars_per_token}


def rank(candidates, hashes, prompt_tokens=700, max_tokens=64, seed=0):
    return rank_replicas(candidates, prompt_tokens, max_tokens, random.Random(seed), prefix_hashes=hashes)


def test_cached_tokens_estimate_is_capped_below_the_prompt():
    h = hashes_of(chat("q"))
    c = Candidate("a", stats(prefix=frozenset(h)), 64)
    assert cached_prompt_tokens(c, h, 10_000) == len(h) * TEXT_BLOCK_CHARS // 4
    assert cached_prompt_tokens(c, h, 50) == 49
    assert cached_prompt_tokens(c, None, 50) == 0
    assert cached_prompt_tokens(replace(c, stats={}, recent_hashes=frozenset(h[:3])), h, 10_000) == 3 * 32


def test_idle_replicas_send_a_repeated_prefix_where_it_is_cached():
    h = hashes_of(chat("next turn"))
    holder = Candidate("holder", stats(prefix=frozenset(hashes_of(chat("earlier turn")))), 64)
    other = Candidate("other", stats(prefix=frozenset(hashes_of(chat("x", system="unrelated " * 300)))), 64)
    assert all(rank([other, holder], h, seed=s)[0] == "holder" for s in range(20))
    # without hashes (prefix_aware off) it is a tie, broken at random
    firsts = Counter(rank([other, holder], None, seed=s)[0] for s in range(40))
    assert set(firsts) == {"holder", "other"}
    # recently sent (not in the stats yet) counts as cached too
    fresh = Candidate("fresh", stats(), 64, recent_hashes=frozenset(h))
    assert all(rank([other, fresh], h, seed=s)[0] == "fresh" for s in range(20))


def test_load_beats_the_cache_when_the_holder_is_busy():
    # measured: 6 ms steps at batch 1 (unit 6 ms), 1 ms per prefilled position; the holder saves ~550
    # positions (0.55 s) but each request it holds adds 64 tokens x 6 ms = 0.38 s to the new one's decoding
    h = hashes_of(chat("next turn"))
    def holder(load):
        return Candidate("holder", stats(load, 0.006 * load if load else 0.0, frozenset(h), 0.001), 64)
    other = Candidate("other", stats(1, 0.006, frozenset(), 0.001), 64)
    assert rank([holder(1), other], h)[0] == "holder"
    assert rank([holder(2), other], h)[0] == "holder"   # 0.38 s more decoding < 0.55 s prefill saved
    assert rank([holder(4), other], h)[0] == "other"    # 1.15 s more decoding > 0.55 s
    assert PREFILL_TOKEN_UNITS > 0


def test_a_single_popular_prefix_does_not_pin_traffic_to_one_replica():
    """A stream of requests sharing one long system prompt, each held for 8 arrivals: the router's
    own feedback (held requests, recently sent prefixes) must spread them over all three replicas,
    each of which then caches the prefix."""
    replicas = ["a", "b", "c"]
    held = {r: [] for r in replicas}
    recent, rng = RecentPrefixes(), random.Random(0)
    served = Counter()
    cached = {r: frozenset() for r in replicas}
    for i in range(60):
        h = hashes_of(chat(f"question number {i}"))
        for r in replicas:  # a request is held until 8 more have arrived
            held[r] = [t for t in held[r] if t > i - 8]
        candidates = [Candidate(r, stats(len(held[r]), 0.006 * len(held[r]), cached[r], 0.001), 64,
                                recent_hashes=recent.of(r, float(i))) for r in replicas]
        first = rank_replicas(candidates, 700, 64, rng, prefix_hashes=h)[0]
        held[first].append(i)
        recent.sent(first, h, float(i))
        cached[first] = cached[first] | frozenset(h)
        served[first] += 1
    assert len(served) == 3 and min(served.values()) >= 10, served
    assert all(cached_chars(hashes_of(chat("y")), cached[r]) > 2000 for r in replicas)


def test_recent_prefixes_expire_and_are_bounded():
    recent = RecentPrefixes(ttl_s=5.0, max_per_replica=10)
    recent.sent("a", list(range(8)), now=0.0)
    recent.sent("a", list(range(100, 108)), now=3.0)
    assert recent.of("a", 3.0) == frozenset(range(6, 8)) | frozenset(range(100, 108))  # newest 10
    assert recent.of("a", 6.0) == frozenset(range(100, 108))  # the first batch expired
    assert recent.of("b", 6.0) == frozenset()
    recent.forget_except({"b"})
    assert recent.of("a", 6.0) == frozenset()
