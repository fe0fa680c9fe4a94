"""Speculation settings for benchmarks that measure given draft shapes, whatever the config's policy says."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from workers.speculation.schedule import TablePolicy, fixed_schedule
from workers.speculation.shape import DraftShape


def fixed_speculation(spec, **update):
    """A copy of ``spec`` (a config's ``speculation`` section) with ``policy: fixed`` (``num_beams`` x
    ``draft_len_per_beam`` at every batch size up to ``engine.max_batch_size``) and no table,
    calibration or ``by_compute_path`` entries (a compute path's own would otherwise win), then
    ``update`` (e.g. ``num_beams=4``) applied; validated, so a bad value fails naming its field."""
    data = spec.model_dump(exclude_unset=True)
    data.update(policy="fixed", table=None, calibration=None, by_compute_path=None)
    data.update(update)
    return type(spec).model_validate(data)


@contextmanager
def forced_table(engine, shape: tuple[int, int], max_batch_size: int) -> Iterator[None]:
    """Within the block ``engine`` drafts ``shape`` (num_beams, draft_len_per_beam) up to
    ``max_batch_size`` generation requests and decodes plain above; its own policy comes back after."""
    before = engine.spec_policy
    engine.spec_policy = TablePolicy(fixed_schedule(DraftShape(*shape), max_batch_size))
    try:
        yield
    finally:
        engine.spec_policy = before
