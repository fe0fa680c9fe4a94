"""The compatibility step's engine description (``rdserve eval`` step 2) on every shipped preset: the
default config's policy ``auto`` once crashed it (``'str' object has no attribute 'model_dump'``)."""

import re
from pathlib import Path

import pytest

from cluster.config import load_config
from cluster.evaluation.compatibility import engine_features

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))
SCHEDULE = re.compile(r"^(auto \(the goodput model; calibration .+\)|off|fixed \d+x\d+ at every batch size|"
                      r"((\d+x\d+|off)<=\d+, )+off above)$")


@pytest.mark.parametrize("preset", CONFIGS, ids=lambda p: p.name)
def test_engine_features_describe_every_preset(preset):
    cfg = load_config(preset)
    features = engine_features(cfg)
    assert SCHEDULE.match(features["speculation_policy"]), features["speculation_policy"]
    assert features["speculation_policy"].startswith("auto") == (cfg.speculation.policy == "auto")
    for path in cfg.speculation.by_compute_path or {}:
        assert f"{path}: " in features["speculation_by_compute_path"]


def test_a_table_is_written_row_by_row():
    cfg = load_config(CONFIGS[0])
    table = [{"max_batch_size": 2, "num_beams": 1, "draft_len_per_beam": 2},
             {"max_batch_size": 4, "num_beams": 0, "draft_len_per_beam": 0}]
    spec = cfg.speculation.model_copy(update={"policy": "fixed", "by_compute_path": None, "calibration": None})
    features = engine_features(cfg.model_copy(update={"speculation": spec}))
    assert features["speculation_policy"] == f"fixed {spec.num_beams}x{spec.draft_len_per_beam} at every batch size"
    from workers.speculation.schedule import schedule_text, validate_schedule

    assert schedule_text(validate_schedule(table)) == "1x2<=2, off<=4, off above"
