"""The start-up measurement: step times for the goodput model when no calibration of this machine and code is at hand.

A calibration file recorded on another compute path or code version (:mod:`workers.code_version`)
does not say what a step costs here. Before serving, the engine then times a few iterations of plain
decoding and of every shape the policy may choose, at a few batch sizes
(``speculation.auto.start_batch_sizes``), with :func:`workers.speculation.calibration.measure_step_s`
on short random contexts: a few seconds, logged. The figures seed
:class:`workers.speculation.step_times.LiveStepCosts`; live iterations correct them from then on.
Tokens per step stay the calibration's (acceptance belongs to the model and the traffic, not the
machine). ``rdserve calibrate`` remains the full measurement.
"""

from __future__ import annotations

import logging
import time

from workers.speculation.calibration import measure_step_s
from workers.speculation.goodput import Shape, StepCosts

log = logging.getLogger(__name__)


def measure_seed(engine, shapes: list[Shape], batch_sizes: list[int], tokens_per_step: dict[Shape, float], *,
                 context_len: int = 32, repeats: int = 3, warmup: int = 1) -> StepCosts | None:
    """Step costs measured on ``engine`` (idle, with a drafter): plain and each of ``shapes`` at each
    of ``batch_sizes`` that fits its ``max_batch_size`` and KV cache; median of ``repeats`` iterations
    after ``warmup``, ``context_len`` cached tokens per request. None when no batch size could be
    measured (the caller keeps its seed).

    Raises:
        RuntimeError: the engine is not idle.
        ValueError: ``shapes`` has a shape without ``tokens_per_step``.
    """
    missing = [s for s in shapes if s not in tokens_per_step]
    if missing:
        raise ValueError(f"no tokens_per_step for shape {missing[0]}")
    context_len = min(context_len, engine.max_seq_len // 2)
    t0 = time.perf_counter()
    plain_s: dict[int, float] = {}
    spec_s: dict[Shape, dict[int, float]] = {}
    for b in sorted({b for b in batch_sizes if 1 <= b <= engine.options.max_batch_size}):
        try:
            row = {None: measure_step_s(engine, b, None, context_len=context_len, repeats=repeats, warmup=warmup)}
            for shape in shapes:
                row[shape] = measure_step_s(engine, b, shape, context_len=context_len, repeats=repeats, warmup=warmup)
        except RuntimeError as err:
            if engine.num_unfinished:
                raise
            log.info("start-up step-time measurement: batch %d skipped (%s)", b, err)
            continue
        plain_s[b] = row.pop(None)
        for shape, seconds in row.items():
            spec_s.setdefault(shape, {})[b] = seconds
    if not plain_s:
        return None
    log.info("start-up step-time measurement on compute path %s took %.1f s: %s", engine.compute_path,
             time.perf_counter() - t0, "; ".join(
                 f"batch {b}: plain {plain_s[b] * 1e3:.1f} ms, " + ", ".join(
                     f"{s} {spec_s[s][b] * 1e3:.1f} ms" for s in shapes) for b in sorted(plain_s)))
    return StepCosts(plain_s=plain_s, spec_s=spec_s, tokens_per_step={s: tokens_per_step[s] for s in shapes})
