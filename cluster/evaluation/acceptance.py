"""Step 3, acceptance: how many drafted tokens the base model accepts, by category and ReDrafter shape.

Runs in this process on ``workers.engine.Engine`` objects (one per ``num_beams x draft_len_per_beam``
shape, built from the config with its engine section overridden), greedy, speculative mode. Each
generation step yields one delta whose cumulative ``accepted_draft_tokens`` gives that step's
accepted length ``a``; the step's draft length is ``min(draft_len_per_beam, budget - produced - 1)``
as in ``Engine.generate``.

Figures (ReDrafter arXiv 2403.09919 Sec. 4 reports tokens per step):
- tokens per step: (accepted draft tokens + generation steps) / generation steps;
- acceptance rate at draft position k: among speculative steps that drafted >= k tokens, the
  fraction whose accepted prefix reaches k (``a >= k``);
- drafted tokens per accepted token: ``sum(num_beams * draft_len) / sum(a)``, counting every beam's
  tokens as drafted (before the prefix tree merges shared prefixes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from cluster.config import RdserveConfig
from cluster.evaluation.prompts import PromptRow


@dataclass(frozen=True)
class StepDraft:
    """One speculative step: tokens drafted per beam and tokens accepted from the best beam."""

    draft_len: int
    accepted: int


def steps_from_deltas(accepted_cumulative: Iterable[int], draft_len_per_beam: int, budget: int) -> list[StepDraft]:
    """Per-step drafts from the cumulative accepted counts of one request's deltas.

    accepted_cumulative: ``accepted_draft_tokens`` of each delta after the first (context-phase) one.
    budget: the request's completion budget in tokens. Steps that drafted nothing (plain steps near
    the end of the budget) are left out.
    """
    steps, produced, before = [], 1, 0
    for cumulative in accepted_cumulative:
        accepted = cumulative - before
        draft_len = min(draft_len_per_beam, budget - produced - 1)
        if draft_len >= 1:
            steps.append(StepDraft(draft_len, accepted))
        produced += accepted + 1
        before = cumulative
    return steps


def acceptance_figures(steps: Sequence[StepDraft], num_generation_steps: int, num_beams: int,
                       draft_len_per_beam: int) -> dict:
    """Tokens per step, acceptance rate per draft position (1-based list), drafted per accepted token."""
    accepted = sum(s.accepted for s in steps)
    drafted = sum(num_beams * s.draft_len for s in steps)
    by_position = []
    for k in range(1, draft_len_per_beam + 1):
        eligible = [s for s in steps if s.draft_len >= k]
        by_position.append(sum(s.accepted >= k for s in eligible) / len(eligible) if eligible else None)
    return {
        "generation_steps": num_generation_steps,
        "speculative_steps": len(steps),
        "accepted_draft_tokens": accepted,
        "tokens_per_step": (accepted + num_generation_steps) / num_generation_steps if num_generation_steps else None,
        "acceptance_rate_by_position": by_position,
        "drafted_per_accepted": drafted / accepted if accepted else None,
    }


def measure_engine(engine, prompts: Sequence[PromptRow], max_tokens: int) -> dict:
    """Greedy speculative decoding of every prompt; ``{category: figures}`` plus ``"all"``."""
    from workers.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    per_category: dict[str, tuple[list[StepDraft], int]] = {}
    for row in prompts:
        ids = engine.encode_chat(row.messages) if row.messages is not None else engine.encode_prompt(row.prompt)
        budget = min(max_tokens, engine.max_seq_len - len(ids))
        deltas = list(engine.generate(ids, params, "spec"))
        steps = steps_from_deltas((d.accepted_draft_tokens for d in deltas[1:]), engine.speculation.draft_len_per_beam, budget)
        for key in (row.category, "all"):
            prev_steps, prev_n = per_category.get(key, ([], 0))
            per_category[key] = (prev_steps + steps, prev_n + deltas[-1].num_steps)
    return {key: acceptance_figures(steps, n, engine.speculation.num_beams, engine.speculation.draft_len_per_beam)
            for key, (steps, n) in per_category.items()}


def sweep_shapes(cfg: RdserveConfig, prompts: Sequence[PromptRow], shapes: Sequence[tuple[int, int]],
                 max_tokens: int, progress: bool = True) -> dict:
    """``num_beams x draft_len_per_beam`` sweep; one Engine per shape.

    Raises:
        ValueError: the config has no drafter.
    """
    from cluster.replica.build import build_engine

    if cfg.drafter.path is None:
        raise ValueError("acceptance: drafter.path is not set in the config, so there is nothing to measure")
    results = []
    for num_beams, draft_len in tqdm(shapes, desc="acceptance sweep", disable=not progress, leave=False):
        shaped = cfg.model_copy(update={"speculation": cfg.speculation.model_copy(  # the shape, not the config's policy
            update={"num_beams": num_beams, "draft_len_per_beam": draft_len, "policy": "fixed", "table": None,
                    "calibration": None, "by_compute_path": None})})
        engine = build_engine(shaped)
        results.append({"num_beams": num_beams, "draft_len_per_beam": draft_len,
                        "by_category": measure_engine(engine, prompts, max_tokens)})
    return {"max_tokens": max_tokens, "temperature": 0.0, "shapes": results}


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"2x3,4x4"`` -> ``[(2, 3), (4, 4)]`` (num_beams x draft_len_per_beam).

    Raises:
        ValueError: a malformed or non-positive item.
    """
    from workers.speculation.shape import DraftShape

    return DraftShape.parse_list(text)
