"""Cache-aware ranking as plain functions (``workers.text_prefix``, ``cluster.routing.ranking``):
routing-text hashes, a replica's index and report, and the ranking with fake replicas that hold prefixes."""

import random
from collections import Counter
from dataclasses import replace

from cluster.replica.stats import PrefixStats
from cluster.routing.ranking import PREFILL_TOKEN_UNITS, Candidate, RecentPrefixes, cached_prompt_tokens, rank_replicas
from workers.text_prefix import (MAX_BLOCKS, MAX_REPORTED, TEXT_BLOCK_CHARS, PrefixIndex, block_tokens, cached_tokens,
                                 routing_text, text_block_hashes)

SYSTEM = "You are a careful assistant for the ACME support desk. " * 40  # ~2200 characters
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing " * 20,
                                           "parameters": {"type": "object", "properties": {}}}} for i in range(6)]


def chat(user: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def hashes_of(messages=None, prompt=None, tools=None, salt=None) -> list[int]:
    return text_block_hashes(routing_text(prompt, messages, tools, salt))


def held(hashes: list[int], chars_per_token: float = 4.0) -> dict[int, int]:
    """What a replica reports for a prompt with these hashes."""
    return block_tokens(hashes, 1 / chars_per_token)


def test_hash_chains_cover_the_whole_prefix_and_follow_message_boundaries():
    a, b = hashes_of(chat("first question")), hashes_of(chat("a different question"))
    shared = len(routing_text(None, chat("x"))) // TEXT_BLOCK_CHARS - 1  # blocks inside the system message
    assert shared >= 15 and a[:shared] == b[:shared]
    assert len(a) == len(routing_text(None, chat("first question"))) // TEXT_BLOCK_CHARS  # full blocks only
    # one character changed in the first block changes every hash after it (a chain, not per block)
    other = hashes_of(chat("first question", system="Z" + SYSTEM[1:]))
    assert not set(a) & set(other)
    # a salt (quoted: a separator inside it cannot forge another's head) or a raw prompt starts another chain
    assert not set(a) & set(hashes_of(chat("first question"), salt="tenant-2"))
    assert not set(hashes_of(prompt=SYSTEM)) & set(hashes_of(chat("")))
    forged = hashes_of(chat("q"), salt="A" + routing_text(None, chat("q"), cache_salt="A")[len('"A"'):])
    assert not set(forged) & set(hashes_of(chat("q"), salt="A"))
    # key order inside a message does not matter, but the role does (it is rendered first)
    assert hashes_of([{"content": SYSTEM, "role": "system"}]) == hashes_of([{"role": "system", "content": SYSTEM}])
    assert not set(hashes_of([{"role": "user", "content": SYSTEM}])) & set(hashes_of([{"role": "system", "content": SYSTEM}]))
    assert hashes_of(prompt="short") == []
    assert len(hashes_of(prompt="x" * TEXT_BLOCK_CHARS * (MAX_BLOCKS + 50))) == MAX_BLOCKS  # bounded work


def test_tools_sit_where_templates_render_them_after_the_system_prompt():
    # same system prompt, same tools: shared; same tools under another system prompt: nothing shared
    # (the generic tool prompt renders them after the system text, so no token is shared either)
    a, b = hashes_of(chat("q1"), tools=TOOLS), hashes_of(chat("q2"), tools=TOOLS)
    assert len(set(a) & set(b)) >= len(routing_text(None, chat("q"), TOOLS)) // TEXT_BLOCK_CHARS - 2
    other_system = hashes_of(chat("q1", system="Another tenant's prompt. " * 80), tools=TOOLS)
    assert not set(a) & set(other_system)
    # the system prompt's blocks are shared with the same chat without tools
    assert set(hashes_of(chat("q3"))[:15]) <= set(a)
    # without a system message the tools come first
    user_only = [{"role": "user", "content": "hello " * 50}]
    assert routing_text(None, user_only, TOOLS).index('"tool_0"') < routing_text(None, user_only, TOOLS).index("hello")


def test_cached_tokens_is_the_longest_prefix_held():
    h = hashes_of(chat("question"))
    assert cached_tokens(h, None) == 0 and cached_tokens(h, {}) == 0
    assert cached_tokens(h, held(h[:5])) == 5 * TEXT_BLOCK_CHARS // 4
    assert cached_tokens(h, {h[7]: 300, h[2]: 90}) == 300  # a chain hash stands for its prefix
    assert cached_tokens(h, held(hashes_of(chat("other", system="Z" * 3000)))) == 0
    # stats of another shape (an older replica, garbage) count as nothing cached rather than raising
    assert cached_tokens(h, frozenset(h)) == 0 and cached_tokens(h, 7) == 0
    assert cached_tokens(h, {h[3]: float("nan")}) == 0


def test_index_reports_the_most_recent_prefixes_that_fit_the_cache_roots_first():
    index = PrefixIndex(capacity=100)
    old, new = hashes_of(prompt="o" * 128 * 30), hashes_of(prompt="n" * 128 * 30)
    chars = len(routing_text("o" * 128 * 30, None))
    index.add(old, prompt_tokens=chars // 4, text_chars=chars)  # 32 tokens per block
    index.add(new, prompt_tokens=chars // 4, text_chars=chars)
    assert len(index) == 60
    # room for 40 blocks: all of the newer prompt, and the first 10 blocks of the older (its tail goes
    # first, as the engine evicts least recently released blocks)
    report = index.report(cached_tokens=40 * 32)
    assert set(report) == set(new) | set(old[:10])
    assert cached_tokens(old, report) == 10 * 32 and abs(cached_tokens(new, report) - 30 * 32) <= 1  # chars // 4
    assert index.report(0) == {}
    assert len(index.report(10**9)) == 60
    index.add(hashes_of(prompt="x" * 128 * 80), 1000, 128 * 80)  # over capacity: the oldest go
    assert len(index) == 100 and not set(old) & set(index.report(10**9))
    big = PrefixIndex()
    for i in range(MAX_REPORTED // 1000 + 1):
        big.add(list(range(i * 1000, (i + 1) * 1000)), 32_000, 128_000)
    assert len(big.report(10**9)) == MAX_REPORTED


def test_token_counts_follow_each_prompts_own_characters_per_token():
    # code tokenizes at ~2 characters per token, English at ~5: each prompt's blocks carry its own ratio
    prefix = PrefixStats()
    english, code = routing_text(None, chat("hello")), routing_text(None, chat("x", system="def f(): return [1] " * 120))
    prefix.admitted(english, prompt_tokens=len(english) // 5)
    prefix.admitted(code, prompt_tokens=len(code) // 2)
    report = prefix.index.report(10**6)
    assert abs(cached_tokens(hashes_of(chat("hello")), report) - len(english) // TEXT_BLOCK_CHARS * TEXT_BLOCK_CHARS / 5) < 2
    code_hashes = text_block_hashes(code)
    assert abs(cached_tokens(code_hashes, report) - len(code_hashes) * TEXT_BLOCK_CHARS / 2) < 2


def stats(load=0, step_s=0.0, prefix=None, prefill_s_per_token=0.0) -> dict:
    return {"load": load, "running": load, "waiting": 0, "free_kv_blocks": 1000, "num_kv_blocks": 1000,
            "tokens_per_block": 16, "kv_usage": 0.0, "max_batch_size": 16, "step_s": step_s, "tau": 1.0,
            "shape": "plain", "ttft_p90_s": None, "prefix_hashes": prefix or {},
            "prefill_s_per_token": prefill_s_per_token}


def rank(candidates, hashes, prompt_tokens=700, max_tokens=64, seed=0):
    return rank_replicas(candidates, prompt_tokens, max_tokens, random.Random(seed), prefix_hashes=hashes)


def test_cached_tokens_estimate_is_capped_below_the_prompt():
    h = hashes_of(chat("q"))
    c = Candidate("a", stats(prefix=held(h)), 64)
    assert cached_prompt_tokens(c, h, 10_000) == len(h) * TEXT_BLOCK_CHARS // 4
    assert cached_prompt_tokens(c, h, 50) == 49
    assert cached_prompt_tokens(c, None, 50) == 0
    assert cached_prompt_tokens(replace(c, stats={}, recent_hashes=held(h[:3])), h, 10_000) == 3 * 32


def test_idle_replicas_send_a_repeated_prefix_where_it_is_cached():
    h = hashes_of(chat("next turn"))
    holder = Candidate("holder", stats(prefix=held(hashes_of(chat("earlier turn")))), 64)
    other = Candidate("other", stats(prefix=held(hashes_of(chat("x", system="unrelated " * 300)))), 64)
    assert all(rank([other, holder], h, seed=s)[0] == "holder" for s in range(20))
    # without hashes (prefix_aware off) it is a tie, broken at random
    firsts = Counter(rank([other, holder], None, seed=s)[0] for s in range(40))
    assert set(firsts) == {"holder", "other"}
    # recently sent (not in the stats yet) counts as cached too
    fresh = Candidate("fresh", stats(), 64, recent_hashes=held(h))
    assert all(rank([other, fresh], h, seed=s)[0] == "fresh" for s in range(20))


def test_load_beats_the_cache_when_the_holder_is_busy():
    # measured: 6 ms steps at batch 1 (unit 6 ms), 1 ms per prefilled position; the holder saves ~550
    # positions (0.55 s) but each request it holds adds 64 tokens x 6 ms = 0.38 s to the new one's decoding
    h = hashes_of(chat("next turn"))
    def holder(load):
        return Candidate("holder", stats(load, 0.006 * load if load else 0.0, held(h), 0.001), 64)
    other = Candidate("other", stats(1, 0.006, None, 0.001), 64)
    assert rank([holder(1), other], h)[0] == "holder"
    assert rank([holder(2), other], h)[0] == "holder"   # 0.38 s more decoding < 0.55 s prefill saved
    assert rank([holder(4), other], h)[0] == "other"    # 1.15 s more decoding > 0.55 s
    assert PREFILL_TOKEN_UNITS > 0


def test_a_single_popular_prefix_does_not_pin_traffic_to_one_replica():
    """A stream of requests sharing one long system prompt, each held for 8 arrivals: the router's
    own feedback (held requests, recently sent prefixes) must spread them over all three replicas,
    each of which then caches the prefix."""
    replicas = ["a", "b", "c"]
    held_ids = {r: [] for r in replicas}
    recent, rng = RecentPrefixes(), random.Random(0)
    served = Counter()
    cached = {r: {} for r in replicas}
    for i in range(60):
        h = hashes_of(chat(f"question number {i}"))
        for r in replicas:  # a request is held until 8 more have arrived
            held_ids[r] = [t for t in held_ids[r] if t > i - 8]
        candidates = [Candidate(r, stats(len(held_ids[r]), 0.006 * len(held_ids[r]), cached[r], 0.001), 64,
                                recent_hashes=recent.of(r, float(i))) for r in replicas]
        first = rank_replicas(candidates, 700, 64, rng, prefix_hashes=h)[0]
        held_ids[first].append(i)
        recent.sent(first, h, float(i))
        cached[first] = {**cached[first], **held(h)}
        served[first] += 1
    assert len(served) == 3 and min(served.values()) >= 10, served
    assert all(cached_tokens(hashes_of(chat("y")), cached[r]) > 500 for r in replicas)


def test_recent_prefixes_expire_are_bounded_and_keep_roots():
    recent = RecentPrefixes(ttl_s=5.0, max_per_replica=12)
    recent.sent("a", list(range(8)), now=0.0)  # at most 12 // 4 = 3 blocks of one prompt: its first ones
    assert set(recent.of("a", 0.0)) == {0, 1, 2}
    assert recent.of("a", 0.0)[2] == 3 * TEXT_BLOCK_CHARS // 4
    for k in range(1, 5):
        recent.sent("a", list(range(100 * k, 100 * k + 3)), now=float(k))
    assert set(recent.of("a", 4.0)) == {100, 101, 102, 200, 201, 202, 300, 301, 302, 400, 401, 402}  # newest 12
    assert set(recent.of("a", 7.5)) == {300, 301, 302, 400, 401, 402}  # older than 5 s expired
    assert recent.of("b", 6.0) == {}
    recent.forget_except({"b"})
    assert recent.of("a", 6.0) == {}
