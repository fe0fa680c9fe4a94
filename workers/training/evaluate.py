"""Held-out acceptance of a drafter: mean tokens per step (accepted draft tokens + 1) per category."""

from __future__ import annotations

from collections import defaultdict

from tqdm import tqdm

from workers.engine import Engine
from workers.sampling_params import SamplingParams


def tokens_per_step_by_category(engine: Engine, prompts: list[dict], max_tokens: int) -> dict:
    """Greedy speculative decoding of each prompt (``messages`` or ``prompt``, optional ``category``).

    Returns ``{category: {"prompts", "steps", "accepted_draft_tokens", "tokens_per_step"}}`` plus an
    ``"all"`` entry; tokens per step is pooled over steps (sum of accepted + steps / sum of steps).
    """
    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for p in tqdm(prompts, desc="held-out acceptance", unit="prompt"):
        ids = engine.encode_chat(p["messages"]) if "messages" in p else engine.encode_prompt(p["prompt"])
        last = None
        for last in engine.generate(ids, SamplingParams(max_tokens=max_tokens), "spec"):
            pass
        for cat in (p.get("category", "unknown"), "all"):
            acc[cat][0] += 1
            acc[cat][1] += last.num_steps
            acc[cat][2] += last.accepted_draft_tokens
    return {
        cat: {
            "prompts": n, "steps": steps, "accepted_draft_tokens": a,
            "tokens_per_step": round((a + steps) / steps, 3) if steps else 0.0,
        }
        for cat, (n, steps, a) in sorted(acc.items())
    }
