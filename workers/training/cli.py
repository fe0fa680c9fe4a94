"""``rdserve drafter ...``: train a ReDrafter head for a base model by self-distillation."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

drafter_app = typer.Typer(help="Train and export ReDrafter draft heads.", no_args_is_help=True, rich_markup_mode=None)
console = Console()


def _read_prompts(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "messages" not in row and "prompt" not in row:
            raise typer.BadParameter(f"{path}:{n}: each line needs 'prompt' or 'messages'")
        rows.append(row)
    return rows


def _balanced(rows: list[dict], n: int) -> list[dict]:
    """Up to ``n`` rows taken round-robin across categories (so every category is measured)."""
    by_cat: dict[str, list[dict]] = {}
    for r in rows:
        by_cat.setdefault(r.get("category", "unknown"), []).append(r)
    out, i = [], 0
    while len(out) < n and any(i < len(v) for v in by_cat.values()):
        out += [v[i] for v in by_cat.values() if i < len(v)][: n - len(out)]
        i += 1
    return out


@drafter_app.command("train")
def train(
    out: Path = typer.Option(..., help="Output directory for the drafter (config.json, model.safetensors, report)."),
    model: Optional[Path] = typer.Option(None, help="Base model HF directory; default: SmolLM2-135M-Instruct from the cache."),
    prompts: Optional[Path] = typer.Option(None, help="JSONL prompts ('prompt' or 'messages', optional 'category'). Default: built-in sources."),
    datasets_dir: Optional[Path] = typer.Option(None, help="Directory with gsm8k/ and humaneval/ subsets for the built-in sources."),
    data_dir: Optional[Path] = typer.Option(None, help="Where generated self-distillation shards go (resumable). Default: OUT/data."),
    max_prompts: int = typer.Option(0, help="Use only the first N training prompts (0: all)."),
    max_prompt_tokens: int = typer.Option(400, help="Skip prompts longer than this (tokens)."),
    max_new_tokens: int = typer.Option(256, help="Response length cap for data generation (tokens)."),
    gen_batch_size: int = typer.Option(48, help="Sequences decoded together during data generation."),
    gen_dtype: str = typer.Option("float32", help="Base-model dtype for data generation: float32 or bfloat16 (about 2x faster on AMX CPUs; responses can differ from float32 greedy ones late in a sequence)."),
    extra_prompts: int = typer.Option(0, help="Also generate data for up to N training prompts of the extra sources (workers/training/extra_prompts.py), into DATA/extra."),
    steps: int = typer.Option(3000, help="Optimizer steps."),
    batch_size: int = typer.Option(128, help="Training examples per step."),
    lr: float = typer.Option(1e-3, help="Peak AdamW learning rate (cosine decay)."),
    num_draft_layers: int = typer.Option(2, help="Residual blocks in the draft head."),
    head_type: str = typer.Option("shared", help="'shared' (2H->H projection + base LM head) or 'full' (Apple's 2H->V)."),
    draft_len: int = typer.Option(4, help="Drafted positions trained per example (K)."),
    soft_weight: float = typer.Option(1.0, help="Weight of the base model's distribution as a target (0: its greedy tokens only, 1: distribution only, as the committed drafter).", min=0.0, max=1.0),
    draft_vocab_size: int = typer.Option(8192, help="Draft only the most frequent tokens of the training targets (0: whole vocabulary)."),
    eval_prompts: int = typer.Option(24, help="Held-out prompts for the final tokens-per-step report (0: skip)."),
    num_beams: int = typer.Option(4, help="Beam shape for the held-out report."),
    draft_len_per_beam: int = typer.Option(4, help="Beam shape for the held-out report."),
) -> None:
    """Self-distillation: the base model answers the prompts (greedy), and the drafter learns to
    predict its next tokens from its hidden states. Every stage resumes where it stopped."""
    if gen_dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter(f"must be float32 or bfloat16, got {gen_dtype!r}", param_hint="--gen-dtype")
    import torch

    from workers.engine import Engine
    from workers.models.loader import load_model
    from workers.models.pull import pull_default
    from workers.models.tokenizer import apply_chat_template, load_tokenizer
    from workers.training.distill_data import generate_dataset
    from workers.training.extra_prompts import extra_prompts as all_extra_prompts
    from workers.training.evaluate import tokens_per_step_by_category
    from workers.training.prompt_sources import build_prompts, split_of
    from workers.training.train import load_examples, train_drafter

    logging.basicConfig(level=logging.INFO)
    model_dir = model or pull_default()
    base = load_model(model_dir)
    tok = load_tokenizer(model_dir)
    if prompts:
        rows = _read_prompts(prompts)
        text = lambda r: r.get("prompt") or r["messages"][-1]["content"]  # noqa: E731
        train_rows = [r for r in rows if split_of(text(r)) == "train"]
        held_rows = [r for r in rows if split_of(text(r)) == "heldout"]
    else:
        train_rows = build_prompts(datasets_dir, "train")
        held_rows = build_prompts(datasets_dir, "heldout")
    for r in train_rows:
        r["prompt_ids"] = apply_chat_template(tok, r["messages"]) if "messages" in r else tok(r["prompt"])["input_ids"]
    train_rows = [r for r in train_rows if len(r["prompt_ids"]) <= max_prompt_tokens]
    if max_prompts:
        train_rows = train_rows[:max_prompts]
    eos = set(base.config.eos_token_id) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    data = data_dir or out / "data"
    console.print(f"[bold]1/3[/] generating responses for {len(train_rows)} prompts into {data}")
    gen_model = base if gen_dtype == "float32" else load_model(model_dir, dtype=getattr(torch, gen_dtype))
    generate_dataset(gen_model, train_rows, data, max_new_tokens, gen_batch_size, eos)
    if extra_prompts > 0:
        extra = [r for r in all_extra_prompts() if split_of(r["messages"][0]["content"]) == "train"]
        for r in extra:
            r["prompt_ids"] = apply_chat_template(tok, r["messages"])
        extra = [r for r in extra if len(r["prompt_ids"]) <= max_prompt_tokens][:extra_prompts]
        console.print(f"[bold]1/3[/] generating responses for {len(extra)} extra prompts into {data / 'extra'}")
        generate_dataset(gen_model, extra, data / "extra", max_new_tokens, gen_batch_size, eos)
    del gen_model
    console.print("[bold]2/3[/] training")
    examples = load_examples(data, draft_len)
    report = train_drafter(base, examples, out, num_draft_layers=num_draft_layers, head_type=head_type,
                           steps=steps, batch_size=batch_size, lr=lr,
                           draft_vocab_size=draft_vocab_size, soft_weight=soft_weight)
    if eval_prompts > 0 and held_rows:
        console.print(f"[bold]3/3[/] held-out tokens per step on up to {eval_prompts} prompts")
        del base
        engine = Engine(str(model_dir), str(out), num_beams=num_beams, draft_len_per_beam=draft_len_per_beam)
        report["heldout_tokens_per_step"] = tokens_per_step_by_category(engine, _balanced(held_rows, eval_prompts), 128)
        report["heldout_beam_shape"] = {"num_beams": num_beams, "draft_len_per_beam": draft_len_per_beam}
        (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
        table = Table("category", "prompts", "tokens/step")
        for cat, row in report["heldout_tokens_per_step"].items():
            table.add_row(cat, str(row["prompts"]), f"{row['tokens_per_step']:.2f}")
        console.print(table)
    (out / "checkpoint.pt").unlink(missing_ok=True)
    console.print(f"drafter written to {out}")
