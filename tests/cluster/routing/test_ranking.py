"""Replica ranking as plain functions of fake routing stats (``cluster.routing.ranking``)."""

import random
from collections import Counter

import pytest

from cluster.routing.ranking import Candidate, SentSinceStats, admits, expected_completion_s, rank_replicas


def stats(load=0, running=None, waiting=0, free_kv_blocks=100, num_kv_blocks=100, tokens_per_block=16,
          max_batch_size=16, step_s=0.0, tau=1.0) -> dict:
    """Routing stats as ``cluster.replica.stats.engine_stats`` reports them."""
    running = min(load, max_batch_size) if running is None else running
    return {"load": load, "running": running, "waiting": waiting, "free_kv_blocks": free_kv_blocks,
            "num_kv_blocks": num_kv_blocks, "tokens_per_block": tokens_per_block,
            "kv_usage": 1 - free_kv_blocks / num_kv_blocks, "max_batch_size": max_batch_size, "step_s": step_s,
            "tau": tau, "shape": "plain" if tau == 1.0 else "2x3", "ttft_p90_s": None}


def first_choice(candidates, prompt_tokens=10, max_tokens=50, seed=0):
    return rank_replicas(candidates, prompt_tokens, max_tokens, random.Random(seed))[0]


def test_expected_completion_is_queueing_plus_decoding():
    # 0.1 s of a step per request in the batch; the new request makes a batch of 2 -> 0.2 s/step,
    # 100 tokens at tau 2 -> 50 steps -> 10 s
    c = Candidate("a", stats(load=1, step_s=0.1, tau=2.0, max_batch_size=4), 64)
    assert expected_completion_s(c, 100, unit_s=0.1) == pytest.approx(10.0)
    assert expected_completion_s(c, 100, unit_s=0.1, speed=1.5) == pytest.approx(15.0)
    # a full batch of 4 and 1 waiting: decoding 50 steps x 0.4 s = 20 s, plus 2 over the limit leaving
    # in waves of 4, each 20 s -> 10 s of queueing
    c = Candidate("a", stats(load=5, running=4, waiting=1, step_s=0.4, tau=2.0, max_batch_size=4), 64)
    assert expected_completion_s(c, 100, unit_s=0.1) == pytest.approx(30.0)


def test_low_load_spreads_requests():
    a = Candidate("a", stats(load=1, step_s=0.05, tau=2.5), 64)
    b = Candidate("b", stats(load=0, step_s=0.05, tau=2.5), 64)
    assert all(first_choice([a, b], seed=s) == "b" for s in range(20))
    assert rank_replicas([a, b], 10, 50, random.Random(0)) == ["b", "a"]


def test_an_idle_replicas_stale_step_time_does_not_hide_it():
    # "a" last ran a big batch (slow steps), now idle; "b" decodes one request
    a = Candidate("a", stats(load=0, running=0, step_s=0.4, tau=2.0), 64)
    b = Candidate("b", stats(load=1, step_s=0.05, tau=2.0), 64)
    assert first_choice([a, b]) == "a"


def test_a_busy_replica_does_not_look_faster_for_its_bigger_batch():
    # measured steps grow far less than the batch: 4 running at 0.0102 s/step, 1 running at 0.0126
    busy = Candidate("busy", stats(load=4, step_s=0.0102, tau=2.0), 64)
    light = Candidate("light", stats(load=1, step_s=0.0126, tau=2.0), 64)
    assert all(first_choice([busy, light], seed=s) == "light" for s in range(20))


def test_faster_or_higher_tau_replica_is_preferred_at_equal_load():
    slow = Candidate("slow", stats(load=2, step_s=0.2, tau=2.0), 64)
    fast = Candidate("fast", stats(load=2, step_s=0.1, tau=2.0), 64)
    assert all(first_choice([slow, fast], seed=s) == "fast" for s in range(20))
    low = Candidate("low", stats(load=2, step_s=0.1, tau=1.2), 64)
    high = Candidate("high", stats(load=2, step_s=0.1, tau=2.5), 64)
    assert all(first_choice([low, high], seed=s) == "high" for s in range(20))


def test_ties_are_broken_at_random():
    a = Candidate("a", stats(load=1, step_s=0.1, tau=2.0), 64)
    b = Candidate("b", stats(load=1, step_s=0.1, tau=2.0), 64)
    rng = random.Random(7)
    draws = [rank_replicas([a, b], 10, 50, rng) for _ in range(200)]
    assert all(sorted(order) == ["a", "b"] for order in draws)
    firsts = Counter(order[0] for order in draws)
    assert 60 <= firsts["a"] <= 140, firsts


def test_a_replica_without_kv_room_is_never_chosen_while_another_admits():
    # "full" is idle but has 4 free blocks (64 tokens); "busy" is loaded but has room
    full = Candidate("full", stats(load=0, free_kv_blocks=4, step_s=0.05), 64)
    busy = Candidate("busy", stats(load=6, free_kv_blocks=80, step_s=0.3), 64)
    for seed in range(50):
        assert rank_replicas([full, busy], 200, 100, random.Random(seed)) == ["busy", "full"]  # 19 blocks
    assert first_choice([full, busy], prompt_tokens=20, max_tokens=30) == "full"  # 4 blocks fit
    assert not admits(full, 200, 100) and admits(busy, 200, 100)


def test_a_replica_at_max_ongoing_requests_goes_last():
    at_limit = Candidate("at_limit", stats(load=8, step_s=0.01, tau=3.0), 8)
    loaded = Candidate("loaded", stats(load=30, step_s=0.5), 64)
    assert rank_replicas([at_limit, loaded], 10, 50, random.Random(0)) == ["loaded", "at_limit"]


def test_when_none_admits_all_are_still_ranked():
    a = Candidate("a", stats(load=3, free_kv_blocks=1, step_s=0.3), 64)
    b = Candidate("b", stats(load=1, free_kv_blocks=1, step_s=0.1), 64)
    assert rank_replicas([a, b], 100, 100, random.Random(0)) == ["b", "a"]


def test_a_replica_without_stats_counts_by_what_this_router_sent_it():
    new = Candidate("new", {}, 64, sent=0, in_flight=0)
    loaded = Candidate("loaded", stats(load=3, step_s=0.1, tau=2.0), 64)
    assert first_choice([new, loaded]) == "new"
    busy_new = Candidate("new", {}, 64, sent=5, in_flight=5)
    assert first_choice([busy_new, loaded]) == "loaded"


def route_burst(tracker: SentSinceStats, replica_stats: dict, n: int, accept: bool) -> Counter:
    """Route ``n`` requests as concurrent routing does: each is ranked before any earlier one was
    accepted (``accept`` False) or after (True); the stats stay unchanged (no poll in between)."""
    rng, chosen = random.Random(3), Counter()
    for i in range(n):
        candidates = tracker.candidates([(r, s, 64) for r, s in replica_stats.items()], now=0.0)
        replica = rank_replicas(candidates, 30, 30, rng)[0]
        tracker.chosen(replica, f"req-{i}", 60, now=0.0)
        if accept:
            tracker.routed(replica, f"req-{i}", 60)
        chosen[replica] += 1
    return chosen


@pytest.mark.parametrize("accept", [False, True])
def test_a_burst_between_polls_is_spread_by_what_was_sent(accept):
    idle = {"a": stats(step_s=0.1), "b": stats(step_s=0.1)}
    assert route_burst(SentSinceStats(), idle, 8, accept) == Counter(a=4, b=4)
    assert route_burst(SentSinceStats(), {"a": {}, "b": {}}, 8, accept) == Counter(a=4, b=4)  # before the first poll


def candidate(tracker: SentSinceStats, replica: str, replica_stats: dict, now: float = 0.0) -> Candidate:
    return tracker.candidates([(replica, replica_stats, 64)], now)[0]


def test_sent_requests_take_kv_room_until_stats_surely_count_them():
    tracker = SentSinceStats()
    roomy = stats(free_kv_blocks=8)
    assert admits(candidate(tracker, "a", roomy), 30, 30)
    for i in range(2):  # two requests of 64 tokens: 4 blocks each, "a" is full
        tracker.chosen("a", f"req-{i}", 64, now=0.0)
    assert not admits(candidate(tracker, "a", roomy), 30, 30)
    for i in range(2):
        tracker.routed("a", f"req-{i}", 64)
    polled = stats(load=2, free_kv_blocks=0)  # measured at some time since the last stats arrived:
    c = candidate(tracker, "a", polled)        # both requests counted, their blocks maybe not yet
    assert (c.sent, c.sent_tokens, c.in_flight, c.held) == (0, 128, 2, 2)
    polled_again = stats(load=2, free_kv_blocks=0, step_s=0.01)  # measured after the first arrived
    c = candidate(tracker, "a", polled_again)
    assert (c.sent, c.sent_tokens, c.in_flight, c.held) == (0, 0, 2, 2)
    tracker.completed("a", "req-0")  # one ends before the next poll: one fewer than the stats say
    c = candidate(tracker, "a", polled_again)
    assert (c.sent, c.sent_tokens, c.in_flight, c.held) == (-1, -64, 1, 1)


def test_stats_measured_during_a_burst_that_arrive_after_it_ended_do_not_count_it():
    tracker = SentSinceStats()
    candidate(tracker, "a", stats())
    for i in range(4):
        tracker.chosen("a", f"req-{i}", 64, now=0.0)
        tracker.routed("a", f"req-{i}", 64)
    for i in range(4):
        tracker.completed("a", f"req-{i}")
    late = stats(load=4, step_s=0.04)  # measured while the 4 ran, arrives after they ended
    assert candidate(tracker, "a", late).held == 0
    other_router = stats(load=6, step_s=0.05)  # next poll: 6 requests, none of them ours
    assert candidate(tracker, "a", other_router).held == 6


def test_a_rejected_request_counts_where_it_is_chosen_next():
    tracker = SentSinceStats()
    tracker.chosen("a", "req-0", 64, now=0.0)  # "a" is full and rejects it; "b" is chosen and accepts
    tracker.chosen("b", "req-0", 64, now=0.1)
    tracker.completed("a", "req-0")  # the rejection's completion arrives late: "b" keeps the request
    a, b = candidate(tracker, "a", {}), candidate(tracker, "b", {})
    assert (a.in_flight, b.in_flight, b.sent_tokens) == (0, 1, 64)
    tracker.routed("b", "req-0", 64)
    assert (candidate(tracker, "a", {}).in_flight, candidate(tracker, "b", {}).in_flight) == (0, 1)
    tracker.completed("b", "req-0")
    assert candidate(tracker, "b", {}).in_flight == 0


def test_a_choice_never_sent_expires_and_gone_replicas_are_forgotten():
    tracker = SentSinceStats(choice_ttl_s=5.0)
    tracker.chosen("a", "cancelled", 64, now=0.0)
    tracker.chosen("b", "req-1", 64, now=0.0)
    tracker.routed("b", "req-1", 64)
    assert candidate(tracker, "a", {}, now=4.0).in_flight == 1
    assert candidate(tracker, "a", {}, now=6.0).in_flight == 0
    tracker.forget_except({"a"})
    assert candidate(tracker, "b", {}).in_flight == 0
