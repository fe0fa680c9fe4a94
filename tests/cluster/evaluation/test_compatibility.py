"""The compatibility step's engine description (``rdserve eval`` step 2) on every shipped preset: the
default config's ``engine.spec_schedule: auto`` once crashed it (``'str' object has no attribute 'model_dump'``)."""

import re
from pathlib import Path

import pytest

from cluster.config import load_config
from cluster.evaluation.compatibility import engine_features

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))
SCHEDULE = re.compile(r"^(auto|off|fixed shape|((\d+x\d+|off)<=\d+, )+off above)$")


@pytest.mark.parametrize("preset", CONFIGS, ids=lambda p: p.name)
def test_engine_features_describe_every_preset(preset):
    cfg = load_config(preset)
    features = engine_features(cfg)
    assert SCHEDULE.match(features["speculation_schedule"]), features["speculation_schedule"]
    if cfg.engine.spec_schedule == "auto":
        assert features["speculation_schedule"] == "auto"
    for kernel in cfg.engine.spec_schedule_by_kernel or {}:
        assert f"{kernel}: " in features["speculation_schedule_by_kernel"]


def test_a_table_is_written_row_by_row():
    cfg = load_config(CONFIGS[0])
    table = [{"max_batch_size": 2, "num_beams": 1, "draft_len_per_beam": 2},
             {"max_batch_size": 4, "num_beams": 0, "draft_len_per_beam": 0}]
    engine = cfg.engine.model_copy(update={"spec_schedule": None})
    features = engine_features(cfg.model_copy(update={"engine": engine}))
    assert features["speculation_schedule"] == "fixed shape"
    from workers.speculation.schedule import schedule_text, validate_schedule

    assert schedule_text(validate_schedule(table)) == "1x2<=2, off<=4, off above"
