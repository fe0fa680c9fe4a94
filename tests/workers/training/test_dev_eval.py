"""``rdserve drafter eval`` on a tiny model and a trained tiny drafter: the teacher-forced figures
agree with drafting each example by hand, and the speculative figures with the engine's counts."""

from __future__ import annotations

import json
import random

import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from cluster.cli.main import app
from workers.models.loader import load_model
from workers.redrafter.drafter import load_drafter
from workers.training.dev_eval import teacher_forced
from workers.training.distill_data import generate_dataset
from workers.training.train import load_examples


def test_teacher_forced_matches_drafting_by_hand(tiny_model_dirs, trained_drafter_dirs, tmp_path):
    base = load_model(tiny_model_dirs["tied_gqa2"])
    rng = random.Random(1)
    prompts = [{"prompt_ids": [rng.randrange(3, base.config.vocab_size) for _ in range(rng.randint(2, 12))],
                "category": "ab"[i % 2]} for i in range(12)]
    generate_dataset(base, prompts, tmp_path, 16, batch_size=8, eos_ids=set(base.config.eos_token_id))
    ex = load_examples(tmp_path, draft_len=2)
    drafter = load_drafter(trained_drafter_dirs["tied_gqa2"], base.lm_head.weight)
    # a draft vocabulary without some tokens of the responses, so coverage is below 1
    targets = ex.windows[:, 1]
    drafter.restrict_vocab(torch.unique(targets[targets >= 0])[::2])
    embed = base.model.embed_tokens.weight.detach()
    got = teacher_forced(drafter, embed, ex, chunk=7)
    assert set(got) == {"a", "b", "all"}
    hits, counts, inside = [0, 0], [0, 0], 0
    vocab = drafter.draft_vocab.tolist()
    with torch.no_grad():
        for i in range(len(ex.categories)):
            ctx, w = ex.hiddens[ex.ctx_idx[i]].float()[None], ex.windows[i].tolist()
            state = torch.zeros_like(ctx)
            inside += w[1] in vocab
            for k in range(2):
                if w[k + 1] < 0:
                    break
                state = drafter.step_state(state, F.embedding(torch.tensor([w[k]]), embed))
                guess = vocab[int(drafter.logits(ctx, state).argmax())]
                hits[k] += guess == w[k + 1]
                counts[k] += 1
    assert got["all"]["positions"] == len(ex.categories)
    assert got["all"]["top1_per_position"] == [round(h / c, 4) for h, c in zip(hits, counts)]
    assert got["all"]["vocab_coverage"] == round(inside / len(ex.categories), 4) < 1


def test_cli_reports_spec_and_teacher_forced_per_category(tiny_model_dirs, trained_drafter_dirs, tmp_path):
    rows = [{"prompt": f"tell me about item {i} please", "category": "xy"[i % 2]} for i in range(6)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "r.json"
    args = ["drafter", "eval", "--model", str(tiny_model_dirs["tied_gqa2"]), "--drafter",
            str(trained_drafter_dirs["tied_gqa2"]), "--prompts", str(prompts), "--out", str(out),
            "--shapes", "1x1,2x3", "--max-new-tokens", "12", "--per-category", "2", "--draft-len", "3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report["teacher_forced"]) == {"x", "y", "all"}
    assert len(report["teacher_forced"]["all"]["top1_per_position"]) == 3
    one = report["spec"]["1x1"]
    assert {c: r["prompts"] for c, r in one.items()} == {"x": 2, "y": 2, "all": 4}
    for shape, res in report["spec"].items():
        for row in res.values():
            assert row["tokens_per_step"] == round((row["accepted_draft_tokens"] + row["steps"]) / row["steps"], 3)
    # one drafted token per step: a step accepts it or not, so the two figures are one
    assert abs(one["all"]["first_token_acceptance"] - (one["all"]["tokens_per_step"] - 1)) < 2e-3
    # the responses are cached: a second run reuses them, a different length is refused
    again = CliRunner().invoke(app, [*args[:-8], "--shapes", "1x1", "--max-new-tokens", "13", "--per-category", "1"])
    assert again.exit_code != 0 and "max_new_tokens" in again.output
    bad = CliRunner().invoke(app, [*args[:-8], "--shapes", "2by3"])
    assert bad.exit_code != 0 and "--shapes" in bad.output
