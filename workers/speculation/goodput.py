"""The goodput model: expected output tokens/s of a replica, plain or speculative, at batch size b.

One model answers "speculate or not, and how wide" for the engine (every iteration), for the
replica router (expected completion time on each replica) and for two-pool mode (which pool):

- plain decoding: ``b / t_plain(b)`` tokens/s;
- speculation with draft-tree shape ``s = (num_beams, draft_len_per_beam)``:
  ``b * tau(s) / t_spec(b, s)`` tokens/s,

where ``t_plain`` and ``t_spec`` are seconds per generation step measured by ``rdserve calibrate``
(its JSON, kept next to the config) and interpolated linearly in ``b``, and ``tau(s)`` is the mean
tokens per step (accepted draft tokens + 1; ReDrafter arXiv 2403.09919 Sec. 4). ``tau`` is seeded
from calibration and then follows the live traffic (:mod:`workers.speculation.controller`): the accepted
draft tokens per step of every shape are scaled by the ratio observed on the shape in use, so
traffic whose drafts are mostly rejected turns speculation down by itself.

Pure functions and frozen data; no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Callable

import json
import math
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

from workers.speculation.shape import DraftShape

Shape = DraftShape


def interpolate(points: dict[int, float], x: float) -> float:
    """Piecewise-linear ``points[b]`` at ``x``. Below the first point: the first value (nothing
    measured says a smaller batch is cheaper). Above the last: the last segment's
    slope, never below the last value (a step's cost does not fall as the batch grows; a single
    point is proportional to ``x`` above it).

    Raises:
        ValueError: no points.
    """
    if not points:
        raise ValueError("no measured points to interpolate")
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if len(xs) == 1:
        return points[xs[0]] * x / xs[0]
    i = min(bisect_left(xs, x), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = points[x0], points[x1]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, points[xs[-1]]) if x > xs[-1] else y


@dataclass(frozen=True)
class StepCosts:
    """Measured step costs and calibration acceptance (``rdserve calibrate``'s JSON).

    plain_s: batch size -> seconds per plain generation step.
    spec_s: shape -> (batch size -> seconds per speculative step: drafting + tree verification).
    tokens_per_step: shape -> mean tokens per step on the calibration prompts (the seed of ``tau``).
    """

    plain_s: dict[int, float]
    spec_s: dict[Shape, dict[int, float]]
    tokens_per_step: dict[Shape, float]

    def __post_init__(self):
        if not self.plain_s:
            raise ValueError("calibration has no plain step times (plain_step_s)")
        if not self.spec_s:
            raise ValueError("calibration has no speculative step times (spec_step_s): nothing to choose from")
        for shape in self.spec_s:
            if shape not in self.tokens_per_step:
                raise ValueError(f"calibration times shape {shape[0]}x{shape[1]} but has no tokens_per_step for it")
        for shape, tau in self.tokens_per_step.items():
            if not math.isfinite(tau) or tau < 1:
                raise ValueError(f"tokens_per_step of {shape[0]}x{shape[1]} must be >= 1, got {tau}")
        for name, table in (("plain_step_s", self.plain_s), *((f"spec_step_s {s[0]}x{s[1]}", t) for s, t in self.spec_s.items())):
            for b, t in table.items():
                if b < 1:
                    raise ValueError(f"{name}: batch size must be >= 1, got {b}")
                if not math.isfinite(t) or t <= 0:
                    raise ValueError(f"{name} at batch {b}: seconds must be > 0, got {t}")

    @property
    def shapes(self) -> list[Shape]:
        """Calibrated shapes, smallest tree first."""
        return sorted(self.spec_s, key=lambda s: (s[0] * s[1], s))

    def t_plain(self, b: float) -> float:
        return interpolate(self.plain_s, b)

    def t_spec(self, b: float, shape: Shape) -> float:
        return interpolate(self.spec_s[shape], b)

    @classmethod
    def from_calibration(cls, data: dict) -> "StepCosts":
        """From the JSON ``rdserve calibrate --out`` writes (``plain_step_s`` by batch,
        ``spec_step_s`` by ``"batch:BxD"``, ``tokens_per_step`` by ``"BxD"``).

        Raises:
            ValueError: a missing section or a malformed key, naming it.
        """
        for key in ("plain_step_s", "spec_step_s", "tokens_per_step"):
            if key not in data:
                raise ValueError(f"calibration file has no {key!r}")
        spec: dict[Shape, dict[int, float]] = {}
        for key, seconds in data["spec_step_s"].items():
            batch, _, shape = key.partition(":")
            spec.setdefault(DraftShape.parse(shape), {})[int(batch)] = float(seconds)
        return cls(plain_s={int(b): float(t) for b, t in data["plain_step_s"].items()}, spec_s=spec,
                   tokens_per_step={DraftShape.parse(s): float(v) for s, v in data["tokens_per_step"].items()})

    @classmethod
    def load(cls, path: str | Path) -> "StepCosts":
        """Read a calibration JSON file.

        Raises:
            ValueError: unreadable or malformed (the message names the file).
        """
        try:
            return cls.from_calibration(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, ValueError, TypeError, AttributeError) as err:
            raise ValueError(f"{path}: not a usable calibration file: {err}") from None


def plain_rate(costs: StepCosts, b: float) -> float:
    """Expected output tokens/s of plain decoding at batch ``b``."""
    return b / costs.t_plain(b)


def spec_rate(costs: StepCosts, b: float, shape: Shape, tau: float) -> float:
    """Expected output tokens/s of speculation with ``shape`` at batch ``b``, ``tau`` tokens per step."""
    return b * tau / costs.t_spec(b, shape)


def break_even_tau(costs: StepCosts, b: float, shape: Shape) -> float:
    """Tokens per step at which a speculative step with ``shape`` yields as much as a plain step:
    ``t_spec(b, s) / t_plain(b)``. A request accepting less slows its batch down."""
    return costs.t_spec(b, shape) / costs.t_plain(b)


def live_taus(costs: StepCosts, observed_shape: Shape | None, observed_tau: float | None) -> dict[Shape, float]:
    """``tau`` for every calibrated shape given what the traffic shows on one of them.

    Traffic accepting less than calibration's prompts did (``observed_tau`` below the observed shape's
    calibrated tau): every shape's accepted draft tokens per step (``tau - 1``) scale by the observed
    shape's ratio ``(observed_tau - 1) / (calibrated_tau - 1)`` (hard text fails every beam alike).
    Traffic accepting more: every shape gains the same surplus ``observed_tau - calibrated_tau``, so a
    larger tree keeps only its calibrated lead. Much of such a surplus is text copied from the context,
    which the prompt-lookup beam (:mod:`workers.redrafter.prompt_lookup`) accepts whatever the
    drafter's shape; scaled instead, a 1x1 request copying at 4.65 tokens per step priced a 2x2 tree at
    6.6, and ``auto`` at batch 1 moved to trees that step 1.5x slower for a few more tokens (EPYC Zen 4,
    BENCHMARKS.md section 22: 0.91-0.93x of a fixed 1x1 tree with scaling, 0.94-0.97x with the surplus).
    Without an observation: calibration's.
    """
    calib = costs.tokens_per_step
    if observed_shape is None or observed_tau is None or observed_shape not in calib or calib[observed_shape] <= 1:
        return dict(calib)
    if observed_tau > calib[observed_shape]:
        return {s: observed_tau + (t - calib[observed_shape]) for s, t in calib.items()}
    factor = max(observed_tau - 1.0, 0.0) / (calib[observed_shape] - 1.0)
    return {s: 1.0 + (t - 1.0) * factor for s, t in calib.items()}


@dataclass(frozen=True)
class Choice:
    """A decision: ``shape`` None means plain decoding; ``rate`` its expected tokens/s."""

    shape: Shape | None
    rate: float


def rate_of(costs: StepCosts, b: float, shape: Shape | None, taus: dict[Shape, float]) -> float:
    return plain_rate(costs, b) if shape is None else spec_rate(costs, b, shape, taus[shape])


def best_choice(costs: StepCosts, b: float, taus: dict[Shape, float],
                rate: Callable[[Shape | None], float] | None = None) -> Choice:
    """The choice with the highest expected tokens/s at batch ``b`` (ties: plain, then the smaller
    tree). ``b < 1`` is plain (nothing to decode). ``rate(choice)``: its tokens/s (default
    :func:`rate_of`; the live controller caps it by what the choice delivered)."""
    if b < 1:
        return Choice(None, 0.0)
    rate = rate or (lambda c: rate_of(costs, b, c, taus))
    best = Choice(None, rate(None))
    for shape in costs.shapes:
        r = rate(shape)
        if r > best.rate:
            best = Choice(shape, r)
    return best
