"""Automatic prefix caching: the block bookkeeping, and the engine's output with cache hits equals its
output without the cache (greedy, spec and plain, float32 and GGUF), under eviction, preemption and
concurrent unrelated requests; every reused block holds the request's own prefix; salts isolate.
"""

from __future__ import annotations

import random
from functools import lru_cache

import pytest

from tiny_gguf import weights_variant
from workers.block_manager import BlockManager
from workers.engine_builder import load_engine
from workers.engine_metrics import EngineStats
from workers.prefix_hash import block_hashes
from workers.sampling_params import SamplingParams
from workers.sequence import Sequence

BS = 4


def seq(request_id: str, prompt: list[int]) -> Sequence:
    return Sequence(request_id, prompt, 8)


def test_blocks_are_shared_by_reference_and_cached_until_evicted_lru():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    prompt = list(range(10, 22))  # 3 full blocks
    hashes = block_hashes(prompt, BS)
    a = seq("a", prompt)
    assert bm.match_prefix(a, hashes, 11) == 0  # nothing cached yet
    bm.allocate(a, 12)
    bm.register(a, hashes, 12)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 3
    b = seq("b", prompt + [1, 2])
    assert bm.match_prefix(b, block_hashes(b.prompt_token_ids, BS), 13) == 12
    assert b.block_table == a.block_table and all(bm.holders(x) == ["a", "b"] for x in a.block_table)
    c = seq("c", prompt)
    assert bm.match_prefix(c, hashes, 11) == 8  # at least the last prompt token is computed
    bm.free(a)
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3  # released, still cached
    d = seq("d", list(range(100, 124)))
    bm.allocate(d, 16)  # 3 never-used blocks, then the least recently released cached one: the chain's
    assert bm.num_cached_blocks == 2  # tail (released by b, before c released the first two)
    e = seq("e", prompt + [9])
    assert bm.match_prefix(e, block_hashes(e.prompt_token_ids, BS), 12) == 8  # the first two still match
    with pytest.raises(ValueError, match="cannot free KV block"):
        bm.free(Sequence("x", [1], 1, block_table=[d.block_table[0]]))


def test_salts_and_different_prefixes_do_not_share():
    prompt = list(range(10, 22))
    assert block_hashes(prompt, BS, "tenant-a") != block_hashes(prompt, BS, "tenant-b")
    assert block_hashes(prompt, BS)[:2] == block_hashes(prompt[:8] + [0, 0, 0, 0], BS)[:2]
    assert block_hashes([0] * 4 + prompt[4:], BS)[1] != block_hashes(prompt, BS)[1]  # chained on the parent
    bm = BlockManager(6, BS, enable_prefix_caching=False)
    a = seq("a", prompt)
    bm.allocate(a, 12)
    bm.register(a, block_hashes(prompt, BS), 12)
    assert bm.num_cached_blocks == 0 and bm.match_prefix(seq("b", prompt), block_hashes(prompt, BS), 11) == 0


@pytest.fixture(scope="module")
def engines(tiny_model_dirs, trained_drafter_dirs):
    @lru_cache(maxsize=None)
    def make(variant: str, caching: bool, num_kv_blocks: int = 400, activations: str = "float32", kv: str = "auto"):
        return load_engine(str(tiny_model_dirs[variant]), str(trained_drafter_dirs[variant.split("@")[0]]),
                           num_beams=3, draft_len_per_beam=3, max_seq_len=256, max_batch_size=6, max_num_tokens=64,
                           max_prefill_chunk=24, tokens_per_block=BS, num_kv_blocks=num_kv_blocks,
                           enable_prefix_caching=caching, prompt_lookup_num_tokens=3, decode_activations=activations,
                           kv_cache_dtype=kv)
    return make


def run_all(engine, requests: list[dict], check_blocks: bool = False) -> dict[str, list[int]]:
    """Admit ``requests`` (interleaved arrivals) and step to the end; ``{id: tokens}``. With
    ``check_blocks`` every running request's cached blocks are checked, every iteration, to hold its
    own prefix."""
    pending, out = list(requests), {r["id"]: [] for r in requests}
    rng = random.Random(len(requests))
    while pending or engine.num_unfinished:
        for _ in range(rng.randint(0, 2)):
            if pending:
                r = pending.pop(0)
                engine.add_request(r["id"], r["prompt"], SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True,
                                                                        cache_salt=r.get("salt")), r["mode"])
        for d in engine.step():
            out[d.request_id] += d.token_ids
        if check_blocks:  # a cached block at index i of a table holds exactly that request's prefix of i + 1 blocks
            for s in engine.scheduler.running:
                for i, b in enumerate(s.block_table):
                    h = engine.blocks._hash_of[b]
                    assert h is None or (i < len(s.block_hashes) and h == s.block_hashes[i]), (s.request_id, i)
    return out


@pytest.mark.parametrize("weights, activations, kv", [("float32", "float32", "auto"), ("gguf", "float32", "auto"),
                                                      ("gguf", "int8", "auto"), ("gguf", "int8", "int8")])
def test_a_cache_hit_gives_the_output_of_no_cache_spec_and_plain(engines, weights, activations, kv):
    """The same prompt again (and prompts sharing its prefix) take cached blocks, prefill less, and
    decode exactly as an engine without the cache; drafts were accepted on the cached requests. Also
    on int8 activations, where rounding-level differences flip quantized values: every prompt row is
    computed the same way whatever its chunk (workers.kernels.decode_attention.MAX_ROWS); and on an
    int8 KV cache (each cached row quantized on its own, so a cached block holds the bits a new
    prefill would write)."""
    variant = weights_variant("tied_gqa2", weights)
    cached = engines(variant, True, activations=activations, kv=kv)
    reference = engines(variant, False, activations=activations, kv=kv)
    rng = random.Random(1)
    vocab = len(cached.tokenizer)
    base = [rng.randrange(3, vocab) for _ in range(37)]
    requests = [{"id": f"q{i}", "prompt": base[: rng.randint(20, 37)] + [rng.randrange(3, vocab) for _ in range(i % 5)],
                 "max_tokens": 20, "mode": ("spec", "plain")[i % 2]} for i in range(8)]
    cached.stats = EngineStats()
    try:
        for r in requests:  # one after another: each finds the earlier ones' blocks
            got = [t for d in cached.generate(r["prompt"], SamplingParams(max_tokens=20, ignore_eos=True), r["mode"],
                                              request_id=r["id"]) for t in d.token_ids]
            want = [t for d in reference.generate(r["prompt"], SamplingParams(max_tokens=20, ignore_eos=True),
                                                  r["mode"], request_id=r["id"]) for t in d.token_ids]
            assert got == want, r
        stats = cached.drain_stats()
    finally:
        cached.stats = None
    assert stats.prefix_cache_hits >= 7 * 16 and stats.prefix_cache_queries == sum(len(r["prompt"]) for r in requests)
    assert stats.accepted_tokens > 0


def test_cached_tokens_are_reported_and_salts_isolate(engines):
    engine = engines("tied_gqa2", True)
    prompt = list(range(5, 40))
    first = list(engine.generate(prompt, SamplingParams(max_tokens=2), "plain", request_id="s1"))
    again = list(engine.generate(prompt, SamplingParams(max_tokens=2), "plain", request_id="s2"))
    salted = list(engine.generate(prompt, SamplingParams(max_tokens=2, cache_salt="tenant"), "plain", request_id="s3"))
    salted_again = list(engine.generate(prompt, SamplingParams(max_tokens=2, cache_salt="tenant"), "spec",
                                        request_id="s4"))
    assert first[-1].cached_tokens == 0 and again[-1].cached_tokens == 32  # (35 - 1) // 4 blocks of 4
    assert salted[-1].cached_tokens == 0 and salted_again[-1].cached_tokens == 32
    assert [d.token_ids for d in first] == [d.token_ids for d in again]


@pytest.mark.parametrize("mode", ["spec", "plain", "mixed"])
def test_isolation_under_constant_eviction_and_concurrency(engines, mode):
    """Many conversations, each with its own opening ("codeword") and several turns sharing it, sent
    in rounds next to unrelated requests, on a cache so small that blocks are evicted all the time
    and requests are preempted: every output equals the no-cache engine's for the same request, and
    every reused block held the request's own prefix (checked at every iteration)."""
    small, reference = engines("untied_mqa", True, 30), engines("untied_mqa", False, 400)
    rng = random.Random({"spec": 0, "plain": 1, "mixed": 2}[mode])
    vocab = len(small.tokenizer)
    requests = []
    for conv in range(10):
        codeword = [rng.randrange(3, vocab) for _ in range(12)]
        turn = list(codeword)
        for t in range(3):
            turn = turn + [rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))]
            requests.append({"id": f"c{conv}t{t}", "prompt": list(turn), "max_tokens": rng.randint(4, 16),
                             "mode": mode if mode != "mixed" else rng.choice(["spec", "plain"])})
        requests.append({"id": f"u{conv}", "prompt": [rng.randrange(3, vocab) for _ in range(rng.randint(5, 40))],
                         "max_tokens": 8, "mode": "plain"})
    rng.shuffle(requests)
    small.stats = EngineStats()
    try:
        got = run_all(small, requests, check_blocks=True)
        stats = small.drain_stats()
    finally:
        small.stats = None
    for r in requests:
        want = [t for d in reference.generate(r["prompt"], SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True),
                                              r["mode"], request_id=r["id"]) for t in d.token_ids]
        assert got[r["id"]] == want, r["id"]
    assert stats.prefix_cache_hits > 0, "no cache hits: the test exercised nothing"
    assert stats.num_preemptions > 0, "no preemption: the cache was not under pressure"
    assert small.blocks.num_free_blocks == small.blocks.num_blocks  # every block released


def test_prompt_rows_do_not_depend_on_the_chunking(tiny_model_dirs):
    """What makes a cache hit exact: a prompt's logprobs are bit-identical whether it is prefilled in
    chunks of 16 tokens or in one chunk of 200, also on int8 activations (GGUF blocks)."""
    prompt = [random.Random(3).randrange(3, 300) for _ in range(200)]
    values = []
    for chunk in (16, 200):
        engine = load_engine(str(tiny_model_dirs["untied_mqa@gguf"]), None, max_seq_len=256, max_prefill_chunk=chunk,
                             max_num_tokens=256, decode_activations="int8")
        first = next(engine.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0), "plain"))
        values.append([e.logprob for e in first.prompt_logprobs[1:]])
    assert values[0] == values[1]


def test_prompt_logprobs_compute_every_prompt_position_despite_a_cached_prefix(engines):
    """A request asking for prompt logprobs does not start from cached blocks (a cached position is
    never computed, so it had no logprob and the API failed on it): every entry is there, equal to
    the entries without caching, and its cached_tokens is 0; a request without them still hits."""
    prompt = [random.Random(5).randrange(3, 300) for _ in range(40)]
    cold = engines("tied_gqa2", False)
    want = next(cold.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1), "plain", "cold")).prompt_logprobs
    engine = engines("tied_gqa2", True)
    list(engine.generate(prompt, SamplingParams(max_tokens=2), "plain", "warm"))  # its blocks enter the cache
    first = next(engine.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1), "plain", "asks"))
    assert first.cached_tokens == 0
    assert all(e is not None for e in first.prompt_logprobs)
    assert [(e.token_id, e.logprob) for e in first.prompt_logprobs] == [(e.token_id, e.logprob) for e in want]
    again = next(engine.generate(prompt, SamplingParams(max_tokens=1), "plain", "plain-again"))
    assert again.cached_tokens > 0


def test_prefix_cache_counters_count_only_lookups(engines):
    """``prefix_cache_queries`` counts the prompt tokens of requests that looked the cache up: none with
    caching off (a dashboard would show a 0% hit rate instead of no cache), and none for a request
    that asks for prompt logprobs (it computes every position); the others count, hits included."""
    prompt = [random.Random(7).randrange(3, 300) for _ in range(40)]
    off = engines("tied_gqa2", False)
    off.stats = EngineStats()
    try:
        list(off.generate(prompt, SamplingParams(max_tokens=2), "plain", "off-1"))
        list(off.generate(prompt, SamplingParams(max_tokens=2), "spec", "off-2"))
        stats = off.drain_stats()
    finally:
        off.stats = None
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0) and stats.prompt_tokens == 80
    on = engines("tied_gqa2", True)
    on.stats = EngineStats()
    try:
        list(on.generate(prompt, SamplingParams(max_tokens=2), "plain", "on-1"))
        list(on.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1), "plain", "on-logprobs"))
        again = list(on.generate(prompt, SamplingParams(max_tokens=2), "plain", "on-2"))
        stats = on.drain_stats()
    finally:
        on.stats = None
    assert again[0].cached_tokens > 0
    assert stats.prefix_cache_queries == 2 * len(prompt) and stats.prefix_cache_hits == again[0].cached_tokens
