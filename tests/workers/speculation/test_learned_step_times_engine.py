"""Live step times on a real (tiny) engine: its iterations fill the estimates, a wrong calibration gives
way at batch 1 and 8, and a calibration of other code is replaced by a start-up measurement.

Decisions take their step times from a deterministic source (``table_step_time``) where a test asserts
on them; the tiny model's own speed on a loaded test machine decides nothing.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from step_costs import table_step_time
from workers.code_version import code_version
from workers.engine import Engine
from workers.engine_builder import load_engine
from workers.sampling_params import SamplingParams
from workers.speculation.controller import ControllerSettings, SpecController
from workers.speculation.goodput import StepCosts
from workers.speculation.options import SpeculationOptions
from workers.speculation.policy import step_time_conditions, untrusted_step_times

TAUS = {(1, 2): 1.8, (2, 3): 2.2}
# A tree that pays alone whatever the tiny drafter accepts (1.1x a plain step) and loses at 8 (4x).
TRUE = StepCosts(plain_s={1: 0.010, 8: 0.020}, spec_s={(1, 2): {1: 0.011, 8: 0.080}, (2, 3): {1: 0.011, 8: 0.080}},
                 tokens_per_step=TAUS)
TREES_SLOW = StepCosts(plain_s=TRUE.plain_s, tokens_per_step=TAUS,
                       spec_s={s: {b: 3 * t for b, t in r.items()} for s, r in TRUE.spec_s.items()})
TREES_FREE = StepCosts(plain_s=TRUE.plain_s, spec_s={s: dict(TRUE.plain_s) for s in TRUE.spec_s},
                       tokens_per_step=TAUS)


def make_engine(dirs, drafters, controller=None, **options) -> Engine:
    return load_engine(str(dirs["tied_gqa2"]), str(drafters["tied_gqa2"]), spec_policy=controller, max_seq_len=256,
                       max_batch_size=8, max_num_tokens=256, max_prefill_chunk=64, tokens_per_block=4,
                       num_kv_blocks=800, **options)


def keep_busy(engine: Engine, b: int, iterations: int) -> list:
    """Run ``iterations`` iterations with ``b`` requests in flight (a finished one is replaced); the
    spec shape the policy answered at each generation-only iteration of ``b`` requests."""
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    shapes, real, n = [], engine.spec_policy.shape_for, 0
    engine.spec_policy.shape_for = lambda k: shapes.append((k, real(k))) or shapes[-1][1]
    for _ in range(iterations):
        while engine.num_unfinished < b:
            engine.add_request(f"busy{n}", engine.encode_prompt(f"Story {n}: once upon a time there was a"), params,
                               "spec")
            n += 1
        engine.step()
    engine.abort_all()
    del engine.spec_policy.shape_for
    return [s for k, s in shapes if k == b]


def test_real_iterations_fill_the_live_estimates(tiny_model_dirs, trained_drafter_dirs):
    controller = SpecController(TREES_SLOW, ControllerSettings(patience=2, explore_budget=0.5))
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, controller)
    keep_busy(engine, 1, 60)
    live = controller.costs
    assert live.samples(1, None) > 0 and live.samples(1, (1, 2)) > 0 and live.samples(1, (2, 3)) > 0
    for choice in (None, (1, 2), (2, 3)):  # the tiny model's steps take no 10 ms or 33 ms
        assert live.t(1, choice) == pytest.approx(live.seed_t(1, choice) * live.ratio(1, choice))
        assert live.ratio(1, choice) != 1.0
    assert live.samples(8, None) == 0  # only what ran
    # the engine reports the tokens each iteration emitted: a probe's second iteration (same answer) at least
    delivered = [(b, tokens) for (b, _), window in controller._delivered.items() for _, tokens, _ in window]
    assert delivered and all(b == 1 and tokens >= 1 for b, tokens in delivered)


@pytest.mark.parametrize("b,seed,right", [(1, TREES_SLOW, {(1, 2), (2, 3)}), (8, TREES_FREE, {None})])
def test_a_wrong_calibration_gives_way_on_a_real_engine(tiny_model_dirs, trained_drafter_dirs, b, seed, right):
    controller = SpecController(seed, ControllerSettings(patience=2, explore_budget=0.2),
                                step_time=table_step_time(TRUE))
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, controller)
    shapes = keep_busy(engine, b, 300)
    assert shapes[0] not in right  # the calibration misleads at first
    assert controller.current in right and all(s in right for s in shapes[-50:])


def _calibration(path, compute_path: str | None, version: str | None, **conditions):
    data = {"plain_step_s": {"1": 0.5, "8": 0.9}, "spec_step_s": {"1:1x2": 0.6, "8:1x2": 1.2},
            "tokens_per_step": {"1x2": 1.7}, **conditions}
    if compute_path is not None:
        data["compute_path"] = compute_path
    if version is not None:
        data["code_version"] = version
    path.write_text(json.dumps(data))
    return path


def test_a_calibration_is_trusted_only_on_its_own_path_and_code(tmp_path):
    path = "gguf-avx512-int8"
    assert untrusted_step_times(_calibration(tmp_path / "a.json", path, code_version()), path) is None
    assert "code version 0.0.1+old" in untrusted_step_times(_calibration(tmp_path / "b.json", path, "0.0.1+old"), path)
    other = _calibration(tmp_path / "c.json", "gguf-avx2", code_version())
    assert "compute path gguf-avx2" in untrusted_step_times(other, path)
    assert "record the compute path" in untrusted_step_times(_calibration(tmp_path / "d.json", None, None), path)
    assert "record the code version" in untrusted_step_times(_calibration(tmp_path / "e.json", path, None), path)
    assert "unreadable" in untrusted_step_times(tmp_path / "missing.json", path)


def test_a_calibration_of_another_kv_cache_dtype_or_thread_count_is_not_trusted(tmp_path):
    path, here = "gguf-avx2-int8", step_time_conditions("float16", 2)
    same = _calibration(tmp_path / "a.json", path, code_version(), kv_cache_dtype="float16", num_threads=2)
    assert untrusted_step_times(same, path, here) is None
    f32 = _calibration(tmp_path / "b.json", path, code_version(), kv_cache_dtype="float32", num_threads=2)
    assert untrusted_step_times(f32, path, here) == "was measured with kv_cache_dtype 'float32' (this engine: 'float16')"
    one = _calibration(tmp_path / "c.json", path, code_version(), kv_cache_dtype="float16", num_threads=1)
    assert "num_threads 1 (this engine: 2)" in untrusted_step_times(one, path, here)
    elsewhere = _calibration(tmp_path / "e.json", "gguf-avx512-int8", code_version(), num_threads=32)
    assert "compute path gguf-avx512-int8" in untrusted_step_times(elsewhere, path, here)  # the path first
    assert step_time_conditions("float16", None) == {"kv_cache_dtype": "float16"}  # a GPU engine: no host threads
    unsaid = _calibration(tmp_path / "d.json", path, code_version())  # files recorded before the conditions
    assert untrusted_step_times(unsaid, path, here) is None


def test_an_engine_on_another_kv_cache_dtype_measures_its_step_times_at_start(tiny_model_dirs, trained_drafter_dirs,
                                                                              tmp_path, caplog):
    plain = make_engine(tiny_model_dirs, trained_drafter_dirs, speculation=SpeculationOptions(policy="off"))
    assert plain.step_conditions == step_time_conditions("float32", torch.get_num_threads())
    other = _calibration(tmp_path / "f16.json", plain.compute_path, code_version(),
                         **step_time_conditions("float16", torch.get_num_threads()))
    with caplog.at_level(logging.INFO):
        engine = make_engine(tiny_model_dirs, trained_drafter_dirs,
                             speculation=SpeculationOptions(policy="auto", calibration=other))
    assert engine.spec_policy.costs.seed.plain_s[1] < 0.5  # measured here, not the file's 0.5 s
    assert "kv_cache_dtype 'float16' (this engine: 'float32')" in " ".join(r.getMessage() for r in caplog.records)
    mine = _calibration(tmp_path / "f32.json", plain.compute_path, code_version(), **plain.step_conditions)
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs,
                         speculation=SpeculationOptions(policy="auto", calibration=mine))
    assert engine.spec_policy.costs.seed.plain_s == {1: 0.5, 8: 0.9}


def test_an_old_calibration_is_replaced_by_a_start_up_measurement(tiny_model_dirs, trained_drafter_dirs, tmp_path,
                                                                  caplog):
    old = _calibration(tmp_path / "old.json", None, None)  # written before calibrations recorded code versions
    with caplog.at_level(logging.INFO):
        engine = make_engine(tiny_model_dirs, trained_drafter_dirs,
                             speculation=SpeculationOptions(policy="auto", calibration=old))
    seed = engine.spec_policy.costs.seed
    assert sorted(seed.plain_s) == [1, 8] and sorted(seed.spec_s[(1, 2)]) == [1, 8]
    assert seed.plain_s[1] < 0.5 and seed.tokens_per_step == {(1, 2): 1.7}  # measured times, the file's acceptance
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "not trusted here" in text and "measuring step times at start" in text
    assert "start-up step-time measurement on compute path" in text
    assert engine.num_unfinished == 0 and engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_matching_calibration_or_measure_at_start_off_keeps_the_file(tiny_model_dirs, trained_drafter_dirs, tmp_path):
    plain = make_engine(tiny_model_dirs, trained_drafter_dirs, speculation=SpeculationOptions(policy="off"))
    mine = _calibration(tmp_path / "mine.json", plain.compute_path, code_version())
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, speculation=SpeculationOptions(policy="auto",
                                                                                                calibration=mine))
    assert engine.spec_policy.costs.seed.plain_s == {1: 0.5, 8: 0.9}
    old = _calibration(tmp_path / "old.json", None, None)
    off = SpeculationOptions.model_validate({"policy": "auto", "calibration": old, "auto": {"measure_at_start": False}})
    engine = make_engine(tiny_model_dirs, trained_drafter_dirs, speculation=off)
    assert engine.spec_policy.costs.seed.plain_s == {1: 0.5, 8: 0.9}
