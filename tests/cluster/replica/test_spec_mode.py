"""``cluster.replica.spec_mode.choose_mode``: forced modes, load threshold, no-drafter fallback."""

import pytest

from cluster.config import SpeculationConfig
from cluster.replica.spec_mode import choose_mode


def test_auto_speculates_up_to_spec_max_load():
    cfg = SpeculationConfig(spec_max_load=2, default_mode="auto")
    assert choose_mode(1, None, cfg, True)[0] == "spec"
    assert choose_mode(2, None, cfg, True) == ("spec", "auto: load 2 <= spec_max_load 2")
    assert choose_mode(3, None, cfg, True) == ("plain", "auto: load 3 > spec_max_load 2")
    assert choose_mode(3, "auto", cfg, True)[0] == "plain"


def test_spec_max_load_zero_never_speculates_in_auto():
    assert choose_mode(1, "auto", SpeculationConfig(spec_max_load=0), True)[0] == "plain"


def test_requested_mode_overrides_load_and_default():
    cfg = SpeculationConfig(spec_max_load=0, default_mode="plain")
    assert choose_mode(100, "spec", cfg, True) == ("spec", "requested spec")
    assert choose_mode(1, "plain", SpeculationConfig(default_mode="spec"), True) == ("plain", "requested plain")


def test_default_mode_applies_when_not_requested():
    assert choose_mode(100, None, SpeculationConfig(default_mode="spec"), True) == ("spec", "default_mode spec")
    assert choose_mode(1, None, SpeculationConfig(default_mode="plain"), True) == ("plain", "default_mode plain")


@pytest.mark.parametrize("requested", [None, "auto", "spec", "plain"])
def test_without_drafter_always_plain(requested):
    mode, reason = choose_mode(1, requested, SpeculationConfig(), False)
    assert mode == "plain" and "no drafter" in reason


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="mode"):
        choose_mode(1, "fast", SpeculationConfig(), True)


def test_admission_threshold_follows_the_compute_paths_table():
    """A compute path's own table sets how far auto requests are admitted as speculative (its largest
    speculating batch); elsewhere ``speculation.spec_max_load`` stands."""
    from workers.speculation.policy import select_policy

    spec = SpeculationConfig(spec_max_load=2, by_compute_path={
        "gguf-avx2": {"table": [{"max_batch_size": 4, "num_beams": 2, "draft_len_per_beam": 2},
                                {"max_batch_size": 8, "num_beams": 1, "draft_len_per_beam": 2},
                                {"max_batch_size": 16, "num_beams": 0, "draft_len_per_beam": 0}]},
        "gguf-avx512-int8": {"table": "off"}})
    assert select_policy(spec, "gguf-avx2", 16).spec_max_load == 8
    assert select_policy(spec, "gguf-avx512-int8", 16).spec_max_load == 0
    assert select_policy(spec, "float32-torch", 16).spec_max_load is None  # the configured 2 stands
    assert select_policy(spec, "float32-torch", 16).policy.shapes == [(4, 4)]  # fixed: the configured shape


def test_speculation_unavailable_for_another_cause_says_which():
    """A drafter with ``speculation.policy: off`` can never draft: a forced spec is plain and says why."""
    mode, reason = choose_mode(1, "spec", SpeculationConfig(), False, unavailable="speculation off (speculation.policy)")
    assert mode == "plain" and reason == "speculation off (speculation.policy) (requested spec)"
