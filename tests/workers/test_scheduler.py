"""In-flight batching scheduler: budgets, chunked prefill, preemption by recompute, no starvation."""

from __future__ import annotations

import random

import pytest

from workers.block_manager import BlockManager
from workers.scheduler import Scheduler, SchedulerConfig
from workers.sequence import Sequence, SequenceStatus
from workers.speculation.schedule import validate_schedule

SPEC_2X2 = validate_schedule([{"max_batch_size": 2, "num_beams": 2, "draft_len_per_beam": 2}])


def make(request_id: str, prompt_len: int, max_tokens: int = 8, speculative: bool = True) -> Sequence:
    return Sequence(request_id, [7] * prompt_len, max_tokens=max_tokens, speculative=speculative)


def run_context(plan) -> None:
    """What the engine does after a forward, for the context part: KV computed, first token sampled."""
    for seq, start, n in plan.context:
        assert start == seq.num_computed_tokens
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_context_tokens and not seq.output_token_ids:
            seq.output_token_ids.append(1)


def run_generation(plan, accepted: int = 0) -> None:
    for seq, draft in zip(plan.generation, plan.draft_tokens):
        a = min(accepted, draft)
        seq.num_computed_tokens += 1 + a
        seq.output_token_ids += [2] * (1 + a)


def test_sequence_phases_and_recompute_context():
    s = make("a", 5)
    assert (s.num_tokens, s.num_context_tokens, s.is_prefill, s.num_computed_tokens) == (5, 5, True, 0)
    s.num_computed_tokens = 5
    s.output_token_ids = [1]
    assert (s.num_tokens, s.num_context_tokens, s.is_prefill, s.num_tokens - s.num_computed_tokens) == (6, 5, False, 1)
    s.output_token_ids += [2, 3]
    s.num_computed_tokens = 0  # preempted: recompute prompt + outputs except the last
    assert (s.num_context_tokens, s.is_prefill) == (7, True)
    assert make("b", 5, max_tokens=4).max_slots == 8
    with pytest.raises(ValueError, match="empty prompt"):
        Sequence("c", [], max_tokens=1)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        Sequence("c", [1], max_tokens=0)


def test_chunked_prefill_then_generation_first():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(max_batch_size=4, max_num_tokens=10, max_prefill_chunk=6), bm)
    a, b = make("a", 9), make("b", 3)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [(s.request_id, st, n) for s, st, n in plan.context] == [("a", 0, 6), ("b", 0, 3)]
    assert plan.generation == [] and plan.num_tokens == 9
    run_context(plan)
    plan = sched.schedule()  # b generates first, then a's remaining prompt
    assert plan.generation == [b] and plan.draft_tokens == [0]
    assert [(s.request_id, st, n) for s, st, n in plan.context] == [("a", 6, 3)]
    run_context(plan)
    run_generation(plan)
    plan = sched.schedule()  # generation only: the empty context part
    assert plan.generation == [a, b] and plan.context == [] and plan.spec_shape is None


def test_speculative_trees_mix_with_plain_steps_within_budgets():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(max_batch_size=4, max_num_tokens=12, max_seq_len=64), bm)
    seqs = [make("a", 3), make("b", 3, speculative=False), make("c", 3)]
    for s in seqs:
        sched.add(s)
    run_context(sched.schedule())
    plan = sched.schedule(SPEC_2X2)  # 3 generation requests: above the table's last row
    assert plan.spec_shape is None and plan.draft_tokens == [0, 0, 0]
    sched.finish(seqs[2])
    plan = sched.schedule(SPEC_2X2)
    assert plan.spec_shape == (2, 2) and plan.draft_tokens == [4, 0]
    assert len(seqs[0].block_table) * 4 >= seqs[0].num_tokens + 4
    run_generation(plan, accepted=2)
    assert seqs[0].output_token_ids == [1, 2, 2, 2] and not seqs[0].is_prefill
    # a tree larger than the token budget falls back to a plain step
    big = validate_schedule([{"max_batch_size": 2, "num_beams": 4, "draft_len_per_beam": 4}])
    plan = sched.schedule(big)
    assert plan.draft_tokens == [0, 0] and plan.spec_shape is None



class _NeverDrafts:
    """A policy that gives a shape up to 1 generation request and lets no request draft."""

    def observe_context(self, context):
        pass

    def shape_for(self, b: int):
        return (1, 1) if b <= 1 else None

    def drafts(self, state, b, shape) -> bool:
        return False


def test_a_request_that_forces_speculation_drafts_whatever_the_policy_says():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(max_batch_size=4, max_num_tokens=32, max_seq_len=64), bm)
    forced, other, plain = make("forced", 3), make("other", 3), make("plain", 3, speculative=False)
    forced.force_draft = plain.force_draft = True  # force_draft needs a speculative request
    for s in (forced, other, plain):
        sched.add(s)
    run_context(sched.schedule())
    # the policy decodes 3 requests plain: the forced request alone drafts, at the forced shape
    plan = sched.schedule(_NeverDrafts(), forced_shape=(2, 2))
    assert plan.spec_shape == (2, 2) and plan.draft_tokens == [4, 0, 0]
    # without a forced shape it follows the policy like the others
    assert sched.schedule(_NeverDrafts()).draft_tokens == [0, 0, 0]
    # at the policy's own shape it drafts although policy.drafts says no; the others do not
    sched.finish(plain)
    sched.finish(other)
    plan = sched.schedule(_NeverDrafts(), forced_shape=(2, 2))
    assert plan.spec_shape == (1, 1) and plan.draft_tokens == [1]
    # and with nobody forcing, the plain iteration stays plain
    forced.force_draft = False
    plan = sched.schedule(_NeverDrafts(), forced_shape=(2, 2))
    assert plan.spec_shape is None and plan.draft_tokens == [0]

def test_a_prompt_lookup_beam_reserves_its_slots_and_counts_against_the_budget():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(max_batch_size=4, max_num_tokens=12, max_seq_len=64, lookup_tokens=3), bm)
    a = make("a", 3)
    sched.add(a)
    run_context(sched.schedule())
    plan = sched.schedule(SPEC_2X2)
    assert plan.spec_shape == (2, 2) and plan.draft_tokens == [7]  # 2 x 2 beams + a 3-token lookup beam
    assert len(a.block_table) * 4 >= a.num_tokens + 7
    tight = Scheduler(SchedulerConfig(max_batch_size=4, max_num_tokens=7, lookup_tokens=3), BlockManager(32, 4))
    b = make("b", 3)
    tight.add(b)
    run_context(tight.schedule())
    assert tight.schedule(SPEC_2X2).draft_tokens == [0]  # 1 + 7 tokens > 7: a plain step
    a.lookup.length = 1  # a grown (or reset) beam reserves its own length, not the start length
    run_generation(plan)
    assert sched.schedule(SPEC_2X2).draft_tokens == [5]
    with pytest.raises(ValueError, match="lookup_tokens"):
        SchedulerConfig(max_batch_size=1, max_num_tokens=8, lookup_tokens=-1)


def test_tree_skipped_near_max_seq_len():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(max_batch_size=2, max_num_tokens=16, max_seq_len=12), bm)
    s = make("a", 8, max_tokens=5)
    sched.add(s)
    run_context(sched.schedule())
    assert sched.schedule(SPEC_2X2).draft_tokens == [0]  # 9 tokens + 4 draft slots > 12


def test_blocks_run_out_preempts_the_youngest_and_it_recomputes():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_batch_size=4, max_num_tokens=64), bm)
    old, young = make("old", 7, max_tokens=9), make("young", 7, max_tokens=9)
    sched.add(old)
    sched.add(young)
    run_context(sched.schedule())
    plan = sched.schedule()
    assert plan.generation == [old, young] and bm.num_free_blocks == 0
    run_generation(plan)
    plan = sched.schedule()  # old needs slot 8: a third block
    assert plan.preempted == [young] and plan.generation == [old] and plan.context == []
    assert young.status is SequenceStatus.WAITING and young.block_table == []
    assert young.num_computed_tokens == 0 and young.num_preemptions == 1 and young.output_token_ids == [1, 2]
    while old.status is not SequenceStatus.FINISHED:
        run_generation(plan)
        if len(old.output_token_ids) == old.max_tokens:
            sched.finish(old)
        plan = sched.schedule()
    # young is recomputed (prompt + all outputs but the last), then generates again
    assert [(s, st, n) for s, st, n in plan.context] == [(young, 0, 8)] and plan.generation == []
    run_context(plan)
    assert young.output_token_ids == [1, 2] and not young.is_prefill
    assert sched.schedule().generation == [young]


def test_a_younger_generation_step_is_dropped_for_an_older_context_chunk():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_batch_size=4, max_num_tokens=64, max_prefill_chunk=4), bm)
    old, young = make("old", 12, max_tokens=4), make("young", 3)
    sched.add(old)
    sched.add(young)
    run_context(sched.schedule())  # old: 4 of 12, young: whole prompt
    plan = sched.schedule()
    run_context(plan)
    run_generation(plan)
    plan = sched.schedule()  # old's last chunk needs the block young holds
    assert plan.preempted == [young] and plan.generation == [] and plan.draft_tokens == []
    assert [(s.request_id, st, n) for s, st, n in plan.context] == [("old", 8, 4)]


def test_admission_rejects_what_can_never_fit():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_batch_size=2, max_num_tokens=8, max_seq_len=12), bm)
    with pytest.raises(ValueError, match="needs 17 KV slots, the cache holds 16"):
        sched.add(make("a", 10, max_tokens=8))
    with pytest.raises(ValueError, match="exceeds max_seq_len 12"):
        sched.add(make("b", 10, max_tokens=4))
    sched.add(make("c", 10, max_tokens=3))
    with pytest.raises(ValueError, match="already queued"):
        sched.add(make("c", 1))
    with pytest.raises(ValueError, match="max_num_tokens must be >= 1"):
        SchedulerConfig(max_batch_size=2, max_num_tokens=0)


def test_abort_frees_blocks_of_running_and_waiting():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(max_batch_size=1, max_num_tokens=8), bm)
    a, b = make("a", 6), make("b", 6)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    assert sched.abort("a") is a and a.status is SequenceStatus.FINISHED and bm.num_free_blocks == 8
    assert sched.abort("a") is None
    assert sched.abort("b") is b and not sched.running and not sched.waiting


def test_oldest_request_progresses_under_a_stream_of_newer_ones():
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(SchedulerConfig(max_batch_size=3, max_num_tokens=16), bm)
    oldest = make("oldest", 4, max_tokens=20)
    sched.add(oldest)
    preempted = 0
    for i in range(200):
        sched.add(make(f"new{i}", 6, max_tokens=18))
        plan = sched.schedule()
        assert oldest not in plan.preempted
        preempted += len(plan.preempted)
        run_context(plan)
        run_generation(plan)
        for seq in list(sched.running):
            if len(seq.output_token_ids) >= seq.max_tokens:
                sched.finish(seq)
        if oldest.status is SequenceStatus.FINISHED:
            break
    assert oldest.status is SequenceStatus.FINISHED and i == 19  # one step every iteration
    assert preempted > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_traffic_finishes_every_request_and_frees_every_block(seed):
    """A few hundred requests with random prompt and output lengths, aborts, speculative and plain
    steps, and a cache small enough to force preemption."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=4)
    config = SchedulerConfig(max_batch_size=6, max_num_tokens=24, max_prefill_chunk=10, max_seq_len=96)
    sched = Scheduler(config, bm)
    table = validate_schedule([
        {"max_batch_size": 1, "num_beams": 2, "draft_len_per_beam": 3},
        {"max_batch_size": 3, "num_beams": 2, "draft_len_per_beam": 2},
        {"max_batch_size": 4, "num_beams": 0, "draft_len_per_beam": 0},
        {"max_batch_size": 5, "num_beams": 1, "draft_len_per_beam": 2},
    ])
    pending, stop_at, abort_at = [], {}, {}
    for i in range(300):
        prompt_len = rng.randint(1, 40)
        max_tokens = rng.randint(1, 40)
        s = make(f"r{i}", prompt_len, max_tokens=max_tokens, speculative=rng.random() < 0.7)
        stop_at[s.request_id] = rng.randint(1, max_tokens)  # an EOS before max_tokens
        abort_at[s.request_id] = rng.randint(0, 400) if rng.random() < 0.1 else None
        pending.append(s)
    finished, aborted, first_admitted = [], [], []
    seen = {"no_context": 0, "no_generation": 0, "preempted": 0, "tree_and_plain": 0}
    iteration = 0
    while pending or sched.running or sched.waiting:
        iteration += 1
        assert iteration < 20_000
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            if pending:
                sched.add(pending.pop(0))
        for s in list(sched.running) + list(sched.waiting):
            if abort_at[s.request_id] == iteration:
                assert sched.abort(s.request_id) is s
                aborted.append(s)
        oldest_running = sched.running[0] if sched.running else None
        plan = sched.schedule(table)

        # budgets, FCFS, preemption of the youngest only
        assert plan.num_tokens <= config.max_num_tokens
        assert plan.num_seqs <= config.max_batch_size and len(sched.running) <= config.max_batch_size
        planned = [s for s, _, _ in plan.context] + plan.generation
        assert len(set(map(id, planned))) == len(planned)
        assert all(s.status is SequenceStatus.RUNNING for s in planned)
        assert all(s.status is SequenceStatus.WAITING and s not in planned for s in plan.preempted)
        assert oldest_running is None or oldest_running not in plan.preempted
        if sched.running or sched.waiting:
            assert planned, "an iteration with work left planned nothing"
        running_ids = [s.arrival_index for s in sched.running]
        waiting_ids = [s.arrival_index for s in sched.waiting]
        assert running_ids == sorted(running_ids) and waiting_ids == sorted(waiting_ids)
        assert not running_ids or not waiting_ids or running_ids[-1] < waiting_ids[0]
        for s, _, _ in plan.context:
            if s.request_id not in first_admitted:
                first_admitted.append(s.request_id)

        # blocks: each held by exactly one sequence, waiting sequences hold none
        tables = [b for s in sched.running for b in s.block_table]
        assert len(tables) == len(set(tables)) == bm.num_blocks - bm.num_free_blocks
        assert all(bm.owner(b) == s.request_id for s in sched.running for b in s.block_table)
        assert all(not s.block_table for s in sched.waiting)
        for s, start, n in plan.context:
            assert start == s.num_computed_tokens and start + n <= s.num_context_tokens
            assert len(bm.slots(s, start, start + n)) == n
        for s, draft in zip(plan.generation, plan.draft_tokens):
            assert not s.is_prefill and len(bm.slots(s, 0, s.num_tokens + draft)) == s.num_tokens + draft
            assert draft in (0, plan.spec_shape[0] * plan.spec_shape[1] if plan.spec_shape else 0)

        seen["no_context"] += bool(plan.generation and not plan.context)
        seen["no_generation"] += bool(plan.context and not plan.generation)
        seen["preempted"] += len(plan.preempted)
        seen["tree_and_plain"] += bool(0 in plan.draft_tokens and any(plan.draft_tokens))

        # the engine's side: KV computed, tokens emitted, stops
        run_context(plan)
        for s, draft in zip(plan.generation, plan.draft_tokens):
            accepted = rng.randint(0, min(draft, 3))
            s.num_computed_tokens += 1 + accepted
            s.output_token_ids += [2] * (1 + accepted)
        for s in planned:
            if len(s.output_token_ids) >= stop_at[s.request_id] and s.status is SequenceStatus.RUNNING:
                sched.finish(s)
                finished.append(s)

    assert len(finished) + len(aborted) == 300
    assert all(s.status is SequenceStatus.FINISHED for s in finished + aborted)
    assert all(len(s.output_token_ids) >= stop_at[s.request_id] for s in finished)
    assert bm.num_free_blocks == bm.num_blocks
    assert first_admitted == sorted(first_admitted, key=lambda r: int(r[1:]))
    assert all(seen.values()) and aborted, seen
