"""The speculation policy the engine asks every iteration, and the one place that picks it.

A policy answers, per iteration with ``b`` generation requests: :meth:`SpecPolicy.shape_for` (the
draft-tree shape, or None: plain decoding); per speculative request :meth:`SpecPolicy.drafts`
(whether it drafts now); after the iteration :meth:`SpecPolicy.observe` (what each request
accepted) and :meth:`SpecPolicy.observe_step` (a generation-only iteration's seconds). Two kinds
exist: a table (:class:`workers.speculation.schedule.TablePolicy`: fixed, table or off) and the live
goodput model (:class:`workers.speculation.controller.SpecController`).

:func:`select_policy` reads :class:`~workers.speculation.options.SpeculationOptions` for the compute
path an engine turned out to run on (known once its weights are loaded) and returns the policy with
where it came from. Nothing else interprets ``speculation.policy``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Protocol

from workers.code_version import code_version
from workers.speculation.controller import ControllerSettings, SpecController
from workers.speculation.goodput import StepCosts
from workers.speculation.options import SpeculationOptions
from workers.speculation.schedule import (SpecSchedule, TablePolicy, fixed_schedule, largest_speculating_batch,
                                          schedule_text)
from workers.speculation.shape import DraftShape

log = logging.getLogger(__name__)


class SpecPolicy(Protocol):
    """What the scheduler and engine call (engine thread only)."""

    live: bool  # True: decides per iteration from live acceptance (auto); False: answers from a table

    @property
    def shapes(self) -> list[DraftShape]:
        """Every shape it may choose (the KV cache is sized for the largest tree)."""

    def observe_context(self, context: float | None) -> None:
        """The mean context tokens per generation request of the iteration about to be planned (before
        :meth:`shape_for`; None: no generation request)."""

    def shape_for(self, b: int) -> DraftShape | None: ...

    def min_draft_prob(self, b: int, shape: DraftShape) -> float:
        """The path probability under the drafter a draft token needs to be verified in an iteration of
        ``b`` requests with ``shape`` (:mod:`workers.redrafter.pruning`; 0: every tree whole)."""
        ...
    def new_request_state(self) -> object | None: ...

    def drafts(self, state: object | None, b: int, shape: DraftShape) -> bool: ...

    def observe(self, state: object | None, shape: DraftShape | None, drafted: bool, accepted: int,
                rows: int | None = None) -> None: ...

    def observe_step(self, shape: DraftShape | None, num_generation: int, num_full_trees: int, num_plain: int,
                     seconds: float, context: float | None = None, rows: int | None = None,
                     timed: bool = True, tokens: int | None = None) -> None:
        """A generation-only iteration's seconds, mean context tokens per request and tree rows
        verified; ``timed`` False: it ran on a thread count other than the settled one (see
        ``SpecController.observe_step``); ``tokens``: the tokens its generation requests emitted
        (None: not counted)."""

    def stats(self) -> dict:
        """``shape`` (``BxD`` or None) and ``tau`` (tokens per drafted step, or None) for stats."""


@dataclass(frozen=True)
class SelectedPolicy:
    """A policy and where it came from.

    source: the settings it follows, for logs and ``/health`` (e.g. ``speculation.by_compute_path.gguf-avx2.table``).
    spec_max_load: when a table of this compute path decides (a ``by_compute_path`` table, or the
        fallback of ``auto`` without a calibration), the load up to which requests are admitted as
        speculative (the table's largest speculating batch); None: ``speculation.spec_max_load``.
    measure_at_start: the engine times its steps before serving and reseeds the policy's step costs
        (:mod:`workers.speculation.startup`): the calibration is not of this compute path and code.
    """

    policy: SpecPolicy
    source: str
    spec_max_load: int | None = None
    measure_at_start: bool = False


def select_policy(opts: SpeculationOptions, compute_path: str, max_batch_size: int,
                  conditions: dict | None = None) -> SelectedPolicy:
    """:func:`_select`, and a log line naming whether ``speculation.auto.prune_trees`` is in effect
    (it is read only by the live goodput model; a table verifies whole trees)."""
    selected = _select(opts, compute_path, max_batch_size, conditions)
    if opts.auto.prune_trees:
        if isinstance(selected.policy, SpecController):
            if selected.policy.settings.prune_trees:
                log.info("speculation: draft trees cut by the drafter's confidence (speculation.auto.prune_trees)")
        else:
            log.warning("speculation.auto.prune_trees is not read: the policy in effect is a table (%s), whose trees "
                        "are verified whole", selected.source)
    return selected


def _select(opts: SpeculationOptions, compute_path: str, max_batch_size: int,
            conditions: dict | None = None) -> SelectedPolicy:
    """The policy for an engine on ``compute_path``; ``conditions``: what else its step times depend on
    (:func:`step_time_conditions`), compared with what a calibration file records.

    Order: the path's ``by_compute_path`` entry (its calibration, which needs policy auto, or its
    table); then policy ``auto`` with ``calibration``; ``auto`` without one for this path decodes
    ``num_beams x draft_len_per_beam`` at batch 1 only and logs that ``rdserve calibrate`` is
    missing; ``fixed``: that shape at every batch size up to ``max_batch_size``; ``table``; ``off``.

    Raises:
        ValueError: an unusable calibration file (named).
    """
    entry = (opts.by_compute_path or {}).get(compute_path)
    field = f"speculation.by_compute_path.{compute_path}"
    shape = DraftShape(opts.num_beams, opts.draft_len_per_beam)
    if entry is not None and entry.calibration is not None:
        return _controller(opts, entry.calibration, compute_path, f"{field}.calibration", conditions)
    if entry is not None:
        return _table(entry.table, f"{field}.table", follows_load=True)
    if opts.policy == "auto" and opts.calibration is not None:
        return _controller(opts, opts.calibration, compute_path, "speculation.calibration", conditions)
    if opts.policy == "auto":
        log.warning("speculation.policy 'auto': no calibration and no by_compute_path table for compute path %s; "
                    "speculating with %s at batch 1 only. Run `rdserve calibrate` on this machine", compute_path, shape)
        return _table(fixed_schedule(shape, 1), "speculation.policy auto without a calibration for this compute path",
                      follows_load=True)
    if opts.policy == "fixed":
        return _table(fixed_schedule(shape, max_batch_size), f"speculation.policy fixed {shape}")
    if opts.policy == "table":
        return _table(opts.table, "speculation.table")
    return _table("off", "speculation.policy off")


def _table(table: SpecSchedule, source: str, follows_load: bool = False) -> SelectedPolicy:
    return SelectedPolicy(TablePolicy(table), source, largest_speculating_batch(table) if follows_load else None)


def _controller(opts: SpeculationOptions, path, compute_path: str, field: str,
                conditions: dict | None = None) -> SelectedPolicy:
    """The live goodput model seeded from calibration ``path``; a file of another compute path or code
    version seeds it only until the start-up measurement (``speculation.auto.measure_at_start``)
    or, without one, until live iterations replace its step times."""
    costs = StepCosts.load(path)
    warn_if_measured_elsewhere(path, compute_path, field, opts.draft_search)
    a = opts.auto
    settings = ControllerSettings(margin=a.margin, patience=a.patience, ema_alpha=a.ema_alpha,
                                  request_ema_alpha=a.request_ema_alpha, probe_interval=a.probe_interval,
                                  step_window=a.step_window, explore_samples=a.explore_samples,
                                  explore_budget=a.explore_budget, explore_refresh=a.explore_refresh,
                                  prune_trees=a.prune_trees and opts.draft_search == "distinct_first")
    if a.prune_trees and opts.draft_search != "distinct_first":
        log.warning("speculation.auto.prune_trees is ignored with draft_search %r: only distinct-first drafts carry "
                    "per-token probabilities", opts.draft_search)
    why = untrusted_step_times(path, compute_path, conditions)
    if why is not None:
        log.warning("%s %s %s: its step times are not trusted here (this engine: compute path %s, code %s); %s, and live "
                    "iterations replace them", field, path, why, compute_path, code_version(),
                    "measuring step times at start" if a.measure_at_start else
                    "starting from them (speculation.auto.measure_at_start is off)")
    return SelectedPolicy(SpecController(costs, settings), field,
                          measure_at_start=why is not None and a.measure_at_start)


def policy_text(policy: SpecPolicy) -> str:
    """A policy in one line for logs and ``/health``: ``auto`` (live), ``off``, or a table's rows
    (``1x2<=2, off above``)."""
    return "auto" if policy.live else schedule_text(policy.table)


def measured_on(path) -> tuple[str | None, str | None]:
    """``(compute path, draft_search)`` a calibration file says it was measured with (None: unsaid
    or unreadable; older files name the path ``kernel``)."""
    try:
        data = json.loads(open(path).read())
        return data.get("compute_path", data.get("kernel")), data.get("draft_search")
    except (OSError, ValueError, AttributeError):
        return None, None  # unreadable files are reported by StepCosts.load


def step_time_conditions(kv_cache_dtype: str, num_threads: int | None) -> dict:
    """What a step's cost depends on beside the compute path and the code version, as ``rdserve
    calibrate`` records it: the KV cache's dtype (``"float16"``: decode attention reads half the bytes
    of float32) and the engine's thread count (two replicas of one thread each step about half as
    fast as one of two). ``num_threads`` None: not a condition (a GPU engine's steps do not run on
    the host's threads)."""
    conditions = {"kv_cache_dtype": kv_cache_dtype}
    if num_threads is not None:
        conditions["num_threads"] = int(num_threads)
    return conditions


def untrusted_step_times(path, compute_path: str, conditions: dict | None = None) -> str | None:
    """Why a calibration file's step times do not belong to this engine (None: they do): recorded on
    another compute path, on another code version (:func:`workers.code_version.code_version`), under
    other ``conditions`` (:func:`step_time_conditions`; only those the file records are compared:
    older files record none), or without saying path or version (files of older ``rdserve calibrate``)."""
    try:
        data = json.loads(open(path).read())
        measured, version = data.get("compute_path", data.get("kernel")), data.get("code_version")
    except (OSError, ValueError, AttributeError):
        return "is unreadable"
    if measured is not None and measured != compute_path:
        return f"was measured on compute path {measured}"
    for key, value in (conditions or {}).items():
        if key in data and data[key] != value:
            return f"was measured with {key} {data[key]!r} (this engine: {value!r})"
    if measured is None or version is None:
        return f"does not record the {'compute path' if measured is None else 'code version'} it was measured on " \
               "(an older `rdserve calibrate`)"
    if version != code_version():
        return f"was measured on code version {version}"
    return None


def warn_if_measured_elsewhere(path, compute_path: str, field: str, draft_search: str | None = None) -> None:
    """Log a warning when the calibration file was measured on another compute path (its step costs,
    and so the goodput model's choices, belong to that path) or with another ``draft_search`` (its
    tokens per step belong to that search)."""
    measured, searched = measured_on(path)
    if measured is not None and measured != compute_path:
        log.warning("%s %s was measured on compute path %s, this engine runs on %s: its step costs may not hold "
                    "here; run `rdserve calibrate` on this machine", field, path, measured, compute_path)
    if draft_search is not None and searched is not None and searched != draft_search:
        log.warning("%s %s was measured with speculation.draft_search %s, this engine drafts with %s: its tokens "
                    "per step may not hold; run `rdserve calibrate` with this config", field, path, searched,
                    draft_search)
