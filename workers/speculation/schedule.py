"""Speculation schedule: the draft-tree shape (or none) for each number of generation requests.

Drafting and verifying a tree pays at small batches, where a forward is bound by reading the
weights, and stops paying as the batch grows and the forward becomes compute-bound (TensorRT-LLM's
``max_concurrency`` and ``draft_len_schedule``; vLLM's dynamic speculative decoding).

A table is ``"off"`` or a list of rows ``{max_batch_size, num_beams, draft_len_per_beam}`` with
increasing ``max_batch_size``. A row applies to batches larger than the previous row's
``max_batch_size`` and at most its own; ``num_beams = draft_len_per_beam = 0`` marks speculation off
for that range; batches above the last row run without speculation. In YAML::

    speculation:
      policy: table
      table:
      - {max_batch_size: 2, num_beams: 2, draft_len_per_beam: 2}
      - {max_batch_size: 8, num_beams: 1, draft_len_per_beam: 2}

Shapes are ``(num_beams, draft_len_per_beam)``; a tree holds at most ``num_beams *
draft_len_per_beam`` draft tokens (ReDrafter arXiv 2403.09919 Sec. 3.2).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from workers.speculation.shape import DraftShape, shape_text

Shape = DraftShape


class SpecScheduleRow(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: int = Field(ge=1, description="largest number of generation requests the row covers")
    num_beams: int = Field(ge=0, description="0 with draft_len_per_beam 0: speculation off")
    draft_len_per_beam: int = Field(ge=0)

    @model_validator(mode="after")
    def _both_or_neither_zero(self):
        if (self.num_beams == 0) != (self.draft_len_per_beam == 0):
            raise ValueError(
                f"num_beams and draft_len_per_beam must both be >= 1, or both 0 for speculation off; "
                f"got {self.num_beams}, {self.draft_len_per_beam}"
            )
        return self

    @property
    def shape(self) -> Shape | None:
        return DraftShape(self.num_beams, self.draft_len_per_beam) if self.num_beams else None


def validate_schedule(table: str | list) -> "SpecSchedule":
    """Parse rows (dicts or :class:`SpecScheduleRow`) and check their order.

    Raises:
        ValueError: naming the row (1-based) whose fields are invalid or whose ``max_batch_size`` does
            not exceed the previous row's; a string other than ``"off"``.
    """
    if isinstance(table, str):
        if table != "off":
            raise ValueError(f"speculation schedule: expected 'off' or a list of rows, got {table!r}")
        return "off"
    rows = []
    for i, row in enumerate(table, 1):
        try:
            rows.append(row if isinstance(row, SpecScheduleRow) else SpecScheduleRow(**row))
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(map(str, err['loc'])) or 'row'}: {err['msg']}" for err in e.errors()
            )
            raise ValueError(f"speculation schedule row {i} ({row}): {problems}") from None
        except TypeError:
            raise ValueError(f"speculation schedule row {i}: expected a mapping, got {row!r}") from None
        if i > 1 and rows[-1].max_batch_size <= rows[-2].max_batch_size:
            raise ValueError(
                f"speculation schedule row {i}: max_batch_size {rows[-1].max_batch_size} must exceed "
                f"row {i - 1}'s {rows[-2].max_batch_size}"
            )
    return rows


def yaml_off(value):
    """YAML 1.1 (PyYAML) reads an unquoted ``off`` as ``False``; take it as ``"off"``."""
    return "off" if value is False else value


SpecSchedule = Annotated[Union[Literal["off"], list[SpecScheduleRow]], BeforeValidator(yaml_off),
                         AfterValidator(validate_schedule)]
"""Config field type: pydantic parses the rows and :func:`validate_schedule` checks their order."""


def fixed_schedule(shape: Shape | None, max_batch_size: int) -> "SpecSchedule":
    """One shape at every batch size up to ``max_batch_size`` (``None``: ``"off"``); what a config
    without a table means, and what measurements of a single shape use."""
    if shape is None:
        return "off"
    return [SpecScheduleRow(max_batch_size=max_batch_size, num_beams=shape[0], draft_len_per_beam=shape[1])]


def largest_speculating_batch(table: SpecSchedule) -> int:
    """The largest number of generation requests ``table`` (validated) still drafts for; 0 when off.
    A router that admits requests as speculative up to this load matches the table
    (``speculation.spec_max_load``)."""
    return 0 if table == "off" else max((r.max_batch_size for r in table if r.shape), default=0)


def schedule_text(table: "SpecSchedule | str | None") -> str:
    """A speculation schedule in one line: ``auto`` (the goodput model), ``off``, ``fixed shape`` (None:
    the configured shape at every batch size) or the table's rows, e.g. ``1x2<=2, off<=4, off above``."""
    if table is None:
        return "fixed shape"
    if isinstance(table, str):
        return table
    rows = [f"{r.shape}<={r.max_batch_size}" if r.shape else f"off<={r.max_batch_size}" for r in table]
    return ", ".join(rows) + ", off above"


def choose_shape(table: SpecSchedule, num_generation_requests: int) -> Shape | None:
    """``(num_beams, draft_len_per_beam)`` for a batch of ``num_generation_requests``, or None (off).

    ``table`` must already be validated.
    """
    if table == "off" or num_generation_requests < 1:
        return None
    for row in table:
        if num_generation_requests <= row.max_batch_size:
            return row.shape
    return None


def derive_schedule(
    plain_step_s: dict[int, float],
    spec_step_s: dict[tuple[int, Shape], float],
    tokens_per_step: dict[Shape, float],
) -> SpecSchedule:
    """Table from measured step costs: for each measured batch size the shape with the highest
    expected throughput ``batch * tokens_per_step[shape] / spec_step_s[batch, shape]`` tokens/s, or off
    when plain decoding (``batch / plain_step_s[batch]`` tokens/s) is at least as fast.

    plain_step_s: seconds per plain generation step, by batch size.
    spec_step_s: seconds per speculative step (drafting + tree verification), by (batch size, shape).
    tokens_per_step: mean tokens emitted per speculative step, by shape (acceptance on held-out text).

    Adjacent rows with the same choice are merged and trailing off rows dropped (above the last row
    speculation is off); all off gives ``"off"``. Ties prefer the smaller tree.

    Raises:
        ValueError: a speculative batch size without a plain measurement, a shape without
            ``tokens_per_step``, or a non-positive time.
    """
    for (batch, shape), seconds in spec_step_s.items():
        if batch not in plain_step_s:
            raise ValueError(f"spec_step_s has batch {batch} but plain_step_s does not")
        if shape not in tokens_per_step:
            raise ValueError(f"spec_step_s has shape {shape} but tokens_per_step does not")
        if seconds <= 0:
            raise ValueError(f"spec_step_s[{batch}, {shape}] must be > 0, got {seconds}")
    rows: list[SpecScheduleRow] = []
    for batch in sorted(plain_step_s):
        if plain_step_s[batch] <= 0:
            raise ValueError(f"plain_step_s[{batch}] must be > 0, got {plain_step_s[batch]}")
        best, best_rate = None, batch / plain_step_s[batch]
        candidates = sorted((s for b, s in spec_step_s if b == batch), key=lambda s: (s[0] * s[1], s))
        for shape in candidates:
            rate = batch * tokens_per_step[shape] / spec_step_s[batch, shape]
            if rate > best_rate:
                best, best_rate = shape, rate
        num_beams, draft_len = best or (0, 0)
        if rows and (rows[-1].num_beams, rows[-1].draft_len_per_beam) == (num_beams, draft_len):
            rows[-1] = rows[-1].model_copy(update={"max_batch_size": batch})
        else:
            row = SpecScheduleRow(max_batch_size=batch, num_beams=num_beams, draft_len_per_beam=draft_len)
            rows.append(row)
    while rows and rows[-1].shape is None:
        rows.pop()
    return rows or "off"


class TablePolicy:
    """A fixed speculation schedule as the engine's speculation policy.

    The engine asks its policy, every iteration: :meth:`shape_for` the number of generation
    requests; :meth:`drafts`, per speculative request, whether it drafts now; after the iteration
    :meth:`observe` each generation step. A table answers from its rows alone; the live goodput
    model (``speculation.policy: auto``, :mod:`workers.speculation.controller`) has the same methods
    (:class:`workers.speculation.policy.SpecPolicy`).
    """

    live = False  # answers from its rows: a router can read the load it drafts up to (largest_speculating_batch)

    def __init__(self, table: SpecSchedule, ema_alpha: float = 0.05):
        self.table = table  # validated (see validate_schedule)
        self.ema_alpha = ema_alpha
        self._last_shape: Shape | None = None
        self._tau: float | None = None
        self._iterations = 0  # shape_for calls: none yet means no estimate, not plain decoding

    @property
    def shapes(self) -> list[Shape]:
        return [] if self.table == "off" else [r.shape for r in self.table if r.shape]

    def observe_context(self, context: float | None) -> None:
        """A table's shape does not depend on the context."""

    def shape_for(self, b: int) -> Shape | None:
        self._last_shape = choose_shape(self.table, b)
        self._iterations += 1
        return self._last_shape

    def min_draft_prob(self, b: int, shape: Shape) -> float:
        """A table's shape is verified whole (a forced shape measures what was asked for)."""
        return 0.0

    def new_request_state(self) -> None:
        return None  # a table keeps no per-request state

    def drafts(self, state: None, b: int, shape: Shape) -> bool:
        return True

    def observe(self, state: None, shape: Shape | None, drafted: bool, accepted: int,
                rows: int | None = None) -> None:
        """Keeps a moving average of tokens per drafted step (weight ``ema_alpha``), for stats."""
        if drafted:
            tokens = 1.0 + accepted
            self._tau = tokens if self._tau is None else (1 - self.ema_alpha) * self._tau + self.ema_alpha * tokens

    def observe_step(self, shape: Shape | None, num_generation: int, num_full_trees: int, num_plain: int,
                     seconds: float, context: float | None = None, rows: int | None = None,
                     timed: bool = True, tokens: int | None = None) -> None:
        """A table learns nothing from step times."""

    def stats(self) -> dict:
        """``shape`` of the last iteration (``"BxD"`` or None) and ``tau``: tokens per drafted step
        (None before any draft, and before the first iteration), 1.0 while decoding plain."""
        shape = self._last_shape
        return {"shape": shape_text(shape),
                "tau": None if not self._iterations else 1.0 if shape is None else self._tau}
