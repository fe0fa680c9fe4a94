"""Deterministic step-time sources for controllers driven by real engine iterations: decisions in
tests then follow a known cost model, not the speed of a loaded test machine."""

from __future__ import annotations

from workers.speculation.goodput import StepCosts


def table_step_time(costs: StepCosts):
    """``step_time(b, shape, measured_s)`` for :class:`~workers.speculation.controller.SpecController`:
    the seconds ``costs`` gives plain decoding (``shape`` None) or ``shape`` at batch ``b``, whatever was
    measured."""
    return lambda b, shape, measured_s: costs.t_plain(b) if shape is None else costs.t_spec(b, shape)
