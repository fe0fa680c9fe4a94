"""How well a drafter predicts a base model on a prompt set, per category: what ``rdserve drafter
eval`` reports (the drafter card's figures).

Two measurements:

* **Speculative decoding** (the served engine, greedy, batch 1): mean tokens per step (accepted
  draft tokens + 1, pooled over steps) and first-token acceptance (the fraction of steps where at
  least the first drafted token of some beam was accepted), at a beam shape.
* **Teacher-forced** (the base model's own greedy responses, :mod:`workers.training.distill_data`):
  top-1 accuracy of the drafter at each drafted position 1..K given the true previous tokens, and
  the draft vocabulary's coverage of the response tokens (a token outside it can never be drafted).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from tqdm import tqdm

from workers.redrafter.drafter import ReDrafter
from workers.sampling_params import SamplingParams
from workers.training.train import TrainExamples, drafter_loss


def spec_acceptance(engine, prompts: list[dict], max_tokens: int, desc: str = "speculative decoding") -> dict:
    """Greedy speculative decoding of each prompt (``messages`` or ``prompt``, optional ``category``).

    Returns ``{category: {"prompts", "steps", "accepted_draft_tokens", "tokens_per_step",
    "first_token_acceptance"}}`` plus ``"all"``; steps are the generation steps after the prefill.
    """
    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for p in tqdm(prompts, desc=desc, unit="prompt"):
        ids = engine.encode_chat(p["messages"]) if "messages" in p else engine.encode_prompt(p["prompt"])
        deltas = list(engine.generate(ids, SamplingParams(max_tokens=max_tokens), "spec"))
        per_step = [b.accepted_draft_tokens - a.accepted_draft_tokens for a, b in zip(deltas, deltas[1:])]
        for cat in (p.get("category", "unknown"), "all"):
            row = acc[cat]
            row[0] += 1
            row[1] += len(per_step)
            row[2] += sum(per_step)
            row[3] += sum(1 for a in per_step if a > 0)
    return {
        cat: {
            "prompts": n, "steps": steps, "accepted_draft_tokens": a,
            "tokens_per_step": round((a + steps) / steps, 3) if steps else 0.0,
            "first_token_acceptance": round(hit / steps, 3) if steps else 0.0,
        }
        for cat, (n, steps, a, hit) in sorted(acc.items())
    }


@torch.no_grad()
def teacher_forced(drafter: ReDrafter, embed: torch.Tensor, examples: TrainExamples, chunk: int = 1024) -> dict:
    """Top-1 accuracy per drafted position and draft-vocabulary coverage, per category.

    ``embed``: the base model's input embedding ``[V, H]``; ``examples``: response positions of
    self-distillation records (:func:`workers.training.train.load_examples`, K = window length - 1).
    Returns ``{category: {"positions", "top1_per_position": [K floats], "vocab_coverage"}}`` plus ``"all"``.
    """
    V = embed.shape[0]
    to_draft = None
    if drafter.draft_vocab is not None:
        to_draft = torch.full((V,), -100, dtype=torch.long)
        to_draft[drafter.draft_vocab] = torch.arange(len(drafter.draft_vocab))
    by_cat: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(examples.categories):
        by_cat[c].append(i)
    by_cat["all"] = list(range(len(examples.categories)))
    out = {}
    for cat, rows in sorted(by_cat.items()):
        idx = torch.tensor(rows)
        hits, counts = 0, 0
        for part in idx.split(chunk):
            windows = examples.windows[part]
            _, acc = drafter_loss(drafter, embed, examples.hiddens[examples.ctx_idx[part]].float(), windows, to_draft)
            valid = (windows[:, 1:] >= 0).sum(0)
            hits, counts = hits + acc * valid, counts + valid
        targets = examples.windows[idx, 1]
        targets = targets[targets >= 0]
        covered = 1.0 if to_draft is None else (to_draft[targets] >= 0).float().mean().item()
        out[cat] = {
            "positions": len(rows),
            "top1_per_position": [round(float(h / max(1, int(n))), 4) for h, n in zip(hits, counts)],
            "vocab_coverage": round(covered, 4),
        }
    return out

