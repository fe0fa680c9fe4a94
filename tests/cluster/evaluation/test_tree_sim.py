"""The draft-tree replay (cluster.evaluation.tree_sim): acceptance, tree rows, pricing, the step loop."""

import pytest

from cluster.evaluation.tree_sim import Replay, RowCosts, accepted_length, replay, tree_rows


def test_accepted_length_is_the_longest_matching_beam_prefix():
    assert accepted_length([[5, 6], [5, 7, 8]], [5, 7, 9]) == 2
    assert accepted_length([[5, 6]], [4, 6]) == 0
    assert accepted_length([[1, 2, 3]], [1, 2]) == 2  # the response ends first
    assert accepted_length([], [1]) == 0


def test_tree_rows_counts_the_root_and_each_distinct_prefix_once():
    assert tree_rows([[5, 6], [5, 7]]) == 4  # root, 5, 5-6, 5-7
    assert tree_rows([[5, 6], [5, 6]]) == 3
    assert tree_rows([[5], [9, 9, 9]]) == 5


def test_step_costs_extrapolate_wider_trees_and_refuse_bad_tables():
    costs = RowCosts(plain_ms=10.0, tree_ms=(12.0, 15.0), draft_position_ms=1.0)
    assert costs.spec_ms(2, 1) == 12.0
    assert costs.spec_ms(3, 1) == 15.0
    assert costs.spec_ms(5, 1) == 21.0  # +3 per row beyond the table
    assert costs.spec_ms(3, 3) == 17.0  # two more drafted positions
    assert RowCosts(10.0, (12.0,)).spec_ms(4, 1) == 16.0  # one width: the step from plain repeats
    with pytest.raises(ValueError, match="positive"):
        RowCosts(10.0, ())
    with pytest.raises(ValueError, match="positive"):
        RowCosts(0.0, (12.0,))


def test_replay_walks_the_response_as_the_engine_would():
    prompt, response = [100, 101], list(range(10))
    seen = []

    class Oracle:  # drafts the next two true tokens
        def __call__(self, i, context, limit):
            seen.append((i, list(context), limit))
            return [response[i + 1 : i + 3]], 2

        def observe(self, accepted):
            seen.append(("observed", accepted))

    costs = RowCosts(plain_ms=10.0, tree_ms=(15.0, 20.0))
    r = replay(prompt, response, Oracle(), costs, max_tokens=20)  # ended by its stop token (9)
    # token 0 from the prefill; steps after tokens 0, 3, 6 accept 2 + bonus and reach the end
    assert (r.steps, r.tokens, r.rows) == (3, 9, 9)
    assert r.tokens_per_step == 3.0 and r.rows_per_step == 3.0
    assert r.decode_speedup == pytest.approx(90.0 / 60.0)
    assert seen[0] == (0, prompt + response[:1], 18) and seen[1] == ("observed", [1, 2])
    assert seen[2] == (3, prompt + response[:4], 15)


def test_replay_keeps_the_engines_draft_limit_at_max_tokens():
    response = [0, 1, 2, 3]  # cut by max_tokens 4: after token i the engine drafts at most 4 - (i + 1) - 1
    limits = []

    def oracle(i, context, limit):
        limits.append(limit)
        return [response[i + 1 : i + 1 + limit] + [99, 99]], 2

    r = replay([], response, oracle, RowCosts(10.0, (15.0, 20.0, 25.0)), max_tokens=4)
    # after token 0: 2 drafted (cut from 4), both accepted, bonus 3 -> done; no token counted past the end
    assert limits == [2] and (r.steps, r.tokens, r.rows) == (1, 3, 3)
    short = replay([], response, lambda i, c, limit: ([[response[i + 1]]], 1) if i == 0 else ([[7]], 1),
                   RowCosts(10.0, (15.0,)), max_tokens=4)
    # after token 0: 1 accepted + bonus (token 2); after token 2 nothing may be drafted: a plain step
    assert (short.steps, short.tokens, short.rows) == (2, 3, 3)
    assert short.spec_ms == pytest.approx(15.0 + 10.0)
    with pytest.raises(ValueError, match="below the response"):
        replay([], response, oracle, RowCosts(10.0, (15.0,)), max_tokens=3)


def test_replay_emits_nothing_past_a_stop_token():
    response = [0, 1, 2]  # 2 is the stop token; max_tokens allowed more
    r = replay([], response, lambda i, c, limit: ([[1, 2, 5, 6]], 4), RowCosts(10.0, (12.0, 14.0, 16.0, 18.0)),
               max_tokens=10)
    # the whole rest is drafted and accepted; the bonus after the stop token is dropped, as the engine does
    assert (r.steps, r.tokens, r.rows) == (1, 2, 5)


def test_replay_of_a_policy_that_never_matches_is_one_token_per_step_and_pays_for_its_rows():
    response = [1, 2, 3, 4]
    r = replay([], response, lambda i, ctx, limit: ([[99, 98][:limit]], 2), RowCosts(10.0, (12.0, 14.0), 1.0))
    assert (r.steps, r.tokens) == (3, 3)
    # max_tokens = 4: after token 0 two tokens may be drafted, after token 1 one (a 2-row tree, still two
    # drafted positions: the engine drafts, then cuts), after token 2 none (a plain step)
    assert r.spec_ms == pytest.approx((14.0 + 1.0) + (12.0 + 1.0) + 10.0)
    assert r.decode_speedup < 1.0
    both = replay([], response, lambda i, ctx, limit: ([], 0), RowCosts(10.0, (12.0,)), into=Replay(steps=1, tokens=1))
    assert (both.steps, both.tokens, both.decode_speedup) == (4, 4, pytest.approx(1.0))
