"""Engines on the tiny models with their self-distilled drafters and a 4x4 draft tree, built once per
variant (``<variant>`` or ``<variant>@gguf``), for tests that compare speculative with plain decoding."""

from __future__ import annotations

from functools import lru_cache

from workers.engine_builder import load_engine


def engine_4x4_factory(tiny_model_dirs, trained_drafter_dirs):
    """``make(variant) -> Engine``, cached; the drafter is the base variant's."""

    @lru_cache(maxsize=None)
    def make(variant: str):
        return load_engine(str(tiny_model_dirs[variant]), str(trained_drafter_dirs[variant.split("@")[0]]),
                           num_beams=4, draft_len_per_beam=4, max_seq_len=256)
    return make
