"""Speculation settings: defined here once; the serving config's ``speculation:`` section embeds them.

What a draft tree looks like (``num_beams`` x ``draft_len_per_beam``, the drafter's search, the
prompt-lookup beam) and when the engine drafts (``policy``): ``fixed`` (that shape at every batch
size), ``table`` (rows by number of generation requests, :mod:`workers.speculation.schedule`),
``auto`` (the goodput model from a calibration file, :mod:`workers.speculation.controller`) or
``off``. ``by_compute_path`` overrides the table or calibration per compute path
(:mod:`workers.compute_path`), because step costs belong to the machine and kernels they were
measured on. :func:`workers.speculation.policy.select_policy` turns these into the engine's policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from workers.compute_path import check_compute_path_name
from workers.speculation.schedule import SpecSchedule, yaml_off

POLICIES = ("fixed", "table", "auto", "off")


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AutoSettings(_Options):
    """Hysteresis and estimates of ``policy: auto`` (:class:`workers.speculation.controller.SpecController`)."""

    margin: float = Field(0.05, ge=0, description="another choice must win by this fraction of tokens/s...")
    patience: int = Field(8, ge=1, description="...for this many consecutive iterations before switching")
    ema_alpha: float = Field(0.05, gt=0, le=1, description="replica tokens-per-step moving average weight")
    request_ema_alpha: float = Field(0.2, gt=0, le=1, description="per-request tokens-per-step moving average weight")
    probe_interval: int = Field(8, ge=1, description="a request decoding plain for low acceptance drafts once "
                                "every this many steps")
    step_window: int = Field(16, ge=1, description="live step-time samples per (batch-size bucket, plain or "
                             "shape) whose median corrects the calibration's step time")
    explore_samples: int = Field(2, ge=0, description="plain or a shape with fewer live step-time samples than "
                                 "this at the current batch-size bucket is tried now and then, for two iterations (the second "
                                 "timed)...")
    explore_budget: float = Field(0.05, ge=0, le=1, description="...while such probes take at most this fraction "
                                  "of the generation time (0: never probe)")
    explore_refresh: int = Field(512, ge=1, description="a choice whose newest step-time sample at the current "
                                 "bucket is older than this many samples is probed again (within explore_budget); "
                                 "samples older than this leave the moving median once it is re-sampled")
    measure_at_start: bool = Field(True, description="when the calibration file was recorded on another compute "
                                   "path, code version, kv_cache_dtype or thread count (or records none: older "
                                   "files), time plain and every "
                                   "calibrated shape at start_batch_sizes for a few seconds before serving and start "
                                   "from those step times (logged); false: start from the file's. Live iterations "
                                   "correct either")
    prune_trees: bool = Field(False, description="each request's draft tree keeps only the draft tokens whose "
                              "probability under the drafter (the product along their beam) exceeds what a verified "
                              "row costs at the iteration's batch size and rate (workers/redrafter/pruning.py): "
                              "confident requests verify the whole shape, unsure ones fewer rows or none. Output is "
                              "unchanged; distinct-first drafts only (draft_search). Off by default: on the EPYC "
                              "AVX2 it did not beat whole trees (BENCHMARKS.md 17)")
    start_batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(
        [1, 8], min_length=1, description="batch sizes the start-up measurement times (those above "
        "engine.max_batch_size are skipped)")


class ComputePathPolicy(_Options):
    """One compute path's own speculation: a ``table`` (rows or ``off``) or, with ``policy: auto``,
    a ``calibration`` file measured on that path."""

    table: SpecSchedule | None = Field(None, description="rows {max_batch_size, num_beams, draft_len_per_beam} or "
                                       "'off', used on this path instead of speculation.table / the fixed shape")
    calibration: Path | None = Field(None, description="`rdserve calibrate --out` JSON measured on this path, "
                                     "read instead of speculation.calibration (policy auto)")

    @model_validator(mode="before")
    @classmethod
    def _a_mapping(cls, value):
        if isinstance(value, (str, list)):
            raise ValueError("expected {table: ROWS} or {calibration: FILE}, e.g. gguf-avx2: {calibration: "
                             f"my.calibration.json}}; got {value!r}")
        return value

    @model_validator(mode="after")
    def _one_of_table_or_calibration(self):
        if (self.table is None) == (self.calibration is None):
            raise ValueError("give exactly one of table and calibration")
        return self


class SpeculationOptions(_Options):
    """The draft tree and when to draft (TensorRT-LLM and vLLM option names where they exist)."""

    policy: Annotated[Literal["fixed", "table", "auto", "off"], BeforeValidator(yaml_off)] = Field(
        "fixed", description="'fixed': num_beams x draft_len_per_beam at every batch size; 'table': the rows of "
        "speculation.table by number of generation requests; 'auto': the goodput model picks plain or a shape every "
        "iteration from speculation.calibration's step costs and live acceptance; 'off': never draft")
    num_beams: int = Field(2, ge=1, le=16, description="ReDrafter beams drafted per step (TensorRT-LLM "
                           "redrafter_num_beams); the fixed policy's shape, and the tree of requests that force "
                           "speculation")
    draft_len_per_beam: int = Field(2, ge=1, le=16, description="draft tokens per beam (TensorRT-LLM "
                                    "redrafter_draft_len_per_beam)")
    table: SpecSchedule | None = Field(None, description="policy 'table': rows {max_batch_size, num_beams, "
                                       "draft_len_per_beam} with increasing max_batch_size; above the last row, plain")
    calibration: Path | None = Field(None, description="`rdserve calibrate --out` JSON (step costs by batch size "
                                     "and shape, tokens per step): policy 'auto', and serve.pools' pool choice")
    by_compute_path: dict[Annotated[str, AfterValidator(check_compute_path_name)], ComputePathPolicy] | None = Field(
        None, description="per compute path (e.g. gguf-avx512-int8, gguf-avx2-int8, float32-torch): {table: ...} or "
        "{calibration: ...}; a replica uses its own path's entry, else the settings above. `rdserve calibrate "
        "--write` fills the entry of the path it ran on")
    auto: AutoSettings = Field(default_factory=AutoSettings, description="policy 'auto': hysteresis and estimates")
    draft_search: Literal["beam", "distinct_first"] = Field(
        "distinct_first", description="how the drafter's beams are chosen: 'beam', ReDrafter's beam search "
        "(Sec. 3.2; TensorRT-LLM's), or 'distinct_first', the num_beams most likely first tokens each continued "
        "greedily (more first-token candidates per tree). Verification is unchanged (lossless)")
    prompt_lookup_num_tokens: int = Field(
        0, ge=0, le=16, description="a prompt-lookup beam of this many tokens joins every draft tree: it copies "
        "what followed the latest earlier occurrence of the context's last n tokens (n from prompt_lookup_max down "
        "to prompt_lookup_min; vLLM's names); verification is unchanged (lossless). 0: ReDrafter beams only")
    prompt_lookup_min: int = Field(2, ge=1, le=8, description="shortest n-gram matched by the prompt-lookup beam")
    prompt_lookup_max: int = Field(3, ge=1, le=8, description="longest n-gram matched by the prompt-lookup beam")
    prompt_lookup_max_num_tokens: int | None = Field(
        None, ge=1, le=32, description="after a step that accepted the whole prompt-lookup beam, the next one is "
        "twice as long, up to this many tokens; back to prompt_lookup_num_tokens after any other step. "
        "null = fixed length")

    @model_validator(mode="after")
    def _policy_has_what_it_reads(self):
        paths = self.by_compute_path or {}
        calibrated = sorted(k for k, v in paths.items() if v.calibration is not None)
        if self.policy == "table" and self.table is None:
            raise ValueError("speculation.table: policy 'table' needs the rows")
        if self.policy != "table" and self.table is not None:
            raise ValueError(f"speculation.table: only read with policy 'table' (policy is {self.policy!r})")
        if self.policy == "auto" and self.calibration is None and not calibrated:
            raise ValueError("speculation.calibration: policy 'auto' needs the calibration JSON (`rdserve calibrate "
                             "--out FILE`), or by_compute_path entries with one")
        if self.policy != "auto" and calibrated:
            raise ValueError(f"speculation.by_compute_path.{calibrated[0]}.calibration: only read with policy 'auto' "
                             f"(policy is {self.policy!r})")
        if self.policy == "off" and paths:
            raise ValueError("speculation.by_compute_path: not used with policy 'off'")
        tables = sorted(k for k, v in paths.items() if v.table is not None)
        if self.policy == "auto" and self.calibration is not None and tables:
            raise ValueError(f"speculation.by_compute_path.{tables[0]}.table: not used with policy 'auto' and "
                             "speculation.calibration (every compute path reads a calibration); remove one, or give "
                             "calibrations per path so that the tables serve the paths without one")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculation.prompt_lookup_min: {self.prompt_lookup_min} is above "
                             f"speculation.prompt_lookup_max {self.prompt_lookup_max}")
        if self.prompt_lookup_max_num_tokens is not None and self.prompt_lookup_num_tokens == 0:
            raise ValueError("speculation.prompt_lookup_max_num_tokens: set, but speculation.prompt_lookup_num_tokens "
                             "is 0 (no lookup beam to grow)")
        if self.prompt_lookup_max_num_tokens is not None and self.prompt_lookup_max_num_tokens < self.prompt_lookup_num_tokens:
            raise ValueError(f"speculation.prompt_lookup_max_num_tokens: {self.prompt_lookup_max_num_tokens} is below "
                             f"speculation.prompt_lookup_num_tokens {self.prompt_lookup_num_tokens}")
        return self

    @property
    def longest_lookup(self) -> int:
        """Tokens the prompt-lookup beam may reach (0: no lookup beam)."""
        if not self.prompt_lookup_num_tokens:
            return 0
        return self.prompt_lookup_max_num_tokens or self.prompt_lookup_num_tokens

    def calibration_for(self, compute_path: str) -> Path | None:
        """The calibration JSON a replica on ``compute_path`` reads with policy 'auto': its
        ``by_compute_path`` entry's, else ``calibration`` (None: neither)."""
        entry = (self.by_compute_path or {}).get(compute_path)
        return entry.calibration if entry is not None and entry.calibration is not None else self.calibration

    def calibration_files(self) -> dict[str, Path]:
        """Every calibration file named, by the field naming it (for start checks and packaging)."""
        files = {f"speculation.by_compute_path.{k}.calibration": v.calibration
                 for k, v in (self.by_compute_path or {}).items() if v.calibration is not None}
        if self.calibration is not None:
            files["speculation.calibration"] = self.calibration
        return files

