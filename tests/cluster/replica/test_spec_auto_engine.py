"""``speculation.policy: auto`` on a real (tiny) engine: the live goodput model decides per iteration.

Its step times come from a deterministic source (``table_step_time(COSTS)``), not the test machine's clock.

Whatever it decides (shape, plain, per-request gating), greedy output stays the requests' plain
output; high load turns speculation off; traffic whose drafts fail turns it off by itself.
"""

from __future__ import annotations

import pytest

from step_costs import table_step_time
from workers.speculation.goodput import StepCosts
from workers.speculation.controller import ControllerSettings, SpecController
from workers.engine import Engine
from workers.engine_builder import load_engine
from workers.sampling_params import SamplingParams

# A tree pays at small batches only (plain 10 ms -> 40 ms from batch 1 to 8; a 2x3 tree 12 -> 90 ms).
COSTS = StepCosts(plain_s={1: 0.010, 2: 0.012, 4: 0.020, 8: 0.040},
                  spec_s={(2, 3): {1: 0.012, 2: 0.016, 4: 0.040, 8: 0.090}},
                  tokens_per_step={(2, 3): 2.0})


def make_engine(tiny_model_dirs, trained_drafter_dirs, controller) -> Engine:
    return load_engine(str(tiny_model_dirs["tied_gqa2"]), str(trained_drafter_dirs["tied_gqa2"]), spec_policy=controller,
                       max_seq_len=256, max_batch_size=8, max_num_tokens=256, max_prefill_chunk=64,
                  tokens_per_block=4, num_kv_blocks=800)


def prompts(engine: Engine, n: int) -> list[list[int]]:
    return [engine.encode_prompt(f"Story {i}: once upon a time there was a") for i in range(n)]


def decode_all(engine: Engine, ids: list[list[int]], mode: str, max_tokens: int = 40) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(ids):
        engine.add_request(f"r{i}", p, params, mode)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ids))}
    while engine.num_unfinished:
        for d in engine.step():
            out[d.request_id].extend(d.token_ids)
    return out


def test_auto_is_lossless_and_switches_off_under_load(tiny_model_dirs, trained_drafter_dirs):
    controller = SpecController(COSTS, ControllerSettings(margin=0.05, patience=2), step_time=table_step_time(COSTS))
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, controller)
    assert engine.spec_policy.live
    ids = prompts(engine, 8)
    seen = []
    real = controller.shape_for
    controller.shape_for = lambda b: seen.append((b, real(b))) or seen[-1][1]
    spec = decode_all(engine, ids, "spec")
    plain = decode_all(engine, ids, "plain")
    assert spec == plain
    assert any(b >= 6 and shape is None for b, shape in seen)  # 8 requests: plain pays
    seen.clear()
    solo = decode_all(engine, ids[:1], "spec")
    assert solo["r0"] == plain["r0"]
    assert any(shape == (2, 3) for b, shape in seen if b == 1)  # alone: the tree pays again


def test_hard_traffic_turns_speculation_off_by_itself(tiny_model_dirs, trained_drafter_dirs, monkeypatch):
    controller = SpecController(COSTS, ControllerSettings(margin=0.05, patience=2, ema_alpha=0.3, probe_interval=4),
                                step_time=table_step_time(COSTS))
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, controller)
    ids = prompts(engine, 1)
    plain = decode_all(engine, ids, "plain", max_tokens=60)
    real_run = engine.runner.run

    def rejecting(context, generation, shape, limits, *rest):  # drafts that never survive verification
        results = real_run(context, generation, shape, limits, *rest)
        for r in results:
            if r.generation_step:
                r.accepted_draft_tokens = 0
        return results

    # Only the acceptance counts are hidden from the controller; the tokens are the real ones.
    monkeypatch.setattr(engine.runner, "run", rejecting)
    spec = decode_all(engine, ids, "spec", max_tokens=60)
    assert spec == plain
    assert controller.current is None and controller.switches >= 1 and min(controller.taus().values()) < 1.3


@pytest.mark.parametrize("batch", [3])
def test_per_request_gating_keeps_outputs(tiny_model_dirs, trained_drafter_dirs, batch):
    """A request whose own acceptance is below break-even decodes plain; outputs do not change."""
    controller = SpecController(COSTS, ControllerSettings(margin=0.05, patience=2, probe_interval=3),
                                step_time=table_step_time(COSTS))
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, controller)
    ids = prompts(engine, batch)
    plain = decode_all(engine, ids, "plain")
    gated = []
    real = controller.drafts

    def drafts(state, b, shape):
        state.tau = 1.0  # every request looks hopeless: only probes draft
        decision = real(state, b, shape)
        gated.append(decision)
        return decision

    controller.drafts = drafts
    assert decode_all(engine, ids, "spec") == plain
    assert gated.count(False) > gated.count(True) > 0  # mostly plain, with probes


def _calibration(path, kernel: str, spec_at_1: float):
    """A calibration JSON (``rdserve calibrate``'s form, recorded by this code) for the tiny engine's 2x3 shape."""
    import json

    from workers.code_version import code_version

    path.write_text(json.dumps({"compute_path": kernel, "code_version": code_version(),
                                "plain_step_s": {"1": 0.010, "8": 0.040},
                                "spec_step_s": {"1:2x3": spec_at_1, "8:2x3": 0.090}, "tokens_per_step": {"2x3": 2.0}}))
    return path


def test_each_compute_path_reads_its_own_calibration(tiny_config, tmp_path):
    """speculation.by_compute_path: the replica's path entry drives the goodput model; a path without
    one reads speculation.calibration, else its own table, else decodes the configured shape at batch 1 only."""
    from cluster.replica.build import build_engine

    spec = tiny_config.speculation

    def engine_with(**update):
        cfg = spec.model_validate({**spec.model_dump(exclude_unset=True), **update})
        return build_engine(tiny_config.model_copy(update={"speculation": cfg}))

    path = engine_with(policy="off").compute_path
    mine = _calibration(tmp_path / "mine.json", path, 0.012)
    other = _calibration(tmp_path / "other.json", "cuda", 0.500)
    engine = engine_with(policy="auto", by_compute_path={path: {"calibration": mine}, "cuda": {"calibration": other}})
    assert engine.spec_policy.live and engine.spec_policy.costs.seed.spec_s[(2, 3)][1] == 0.012
    assert engine.spec_policy.shape_for(1) == (2, 3)  # this path's costs: the tree pays alone
    engine = engine_with(policy="auto", by_compute_path={"cuda": {"calibration": other}}, calibration=mine)
    assert engine.spec_policy.costs.seed.spec_s[(2, 3)][1] == 0.012  # no entry for this path: speculation.calibration
    table = [{"max_batch_size": 3, "num_beams": 1, "draft_len_per_beam": 2}]
    engine = engine_with(policy="auto", by_compute_path={"cuda": {"calibration": other}, path: {"table": table}})
    assert [r.model_dump() for r in engine.spec_policy.table] == table  # then its table
    engine = engine_with(policy="auto", by_compute_path={"cuda": {"calibration": other}})
    assert [r.model_dump() for r in engine.spec_policy.table] == \
        [{"max_batch_size": 1, "num_beams": 2, "draft_len_per_beam": 3}]


def test_a_request_forcing_spec_drafts_every_step_while_the_model_decodes_the_rest_plain(
        tiny_model_dirs, trained_drafter_dirs):
    """8 requests: in the iterations where the goodput model decodes plain, the one request that forces
    ``spec`` (a tester's ``rdserve: {mode: spec}`` drew no drafts under ``auto``) still drafts, alone;
    outputs stay plain's."""
    controller = SpecController(COSTS, ControllerSettings(margin=0.05, patience=2), step_time=table_step_time(COSTS))
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, controller)
    ids = prompts(engine, 8)
    plain = decode_all(engine, ids, "plain")
    decisions, plans = [], []
    real_shape_for, real_schedule = controller.shape_for, engine.scheduler.schedule
    controller.shape_for = lambda b: decisions.append(real_shape_for(b)) or decisions[-1]
    engine.scheduler.schedule = lambda *a: plans.append(real_schedule(*a)) or plans[-1]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(ids):
        engine.add_request(f"r{i}", p, params, "spec", force_draft=i == 0)
    out = {f"r{i}": [] for i in range(len(ids))}
    last = {}
    while engine.num_unfinished:
        for d in engine.step():
            out[d.request_id].extend(d.token_ids)
            last[d.request_id] = d
    assert out == plain
    assert last["r0"].accepted_draft_tokens > 0
    plain_iterations = [plan for decision, plan in zip(decisions, plans)
                        if decision is None and any(s.request_id == "r0" for s in plan.generation)]
    assert len(plain_iterations) >= 3, "the model never chose plain while r0 ran: the test would be vacuous"
    for plan in plain_iterations:
        drafting = {s.request_id for s, draft in zip(plan.generation, plan.draft_tokens) if draft}
        assert drafting <= {"r0"} and plan.spec_shape == engine.forced_shape == (2, 3)
    assert sum(bool(dict(zip([s.request_id for s in p.generation], p.draft_tokens)).get("r0"))
               for p in plain_iterations) >= len(plain_iterations) - 1  # a tree may not fit near max_tokens
