"""``rdserve drafter ...``: train a ReDrafter head for a base model by self-distillation."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from workers.training.preflight import check_also_train_on, check_data_settings, check_init_from, check_same_base

drafter_app = typer.Typer(help="Train and export ReDrafter draft heads.", no_args_is_help=True, rich_markup_mode=None)
console = Console()


def _read_prompts(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text().split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise typer.BadParameter(f"{path}:{n}: invalid JSON ({e.msg})") from None
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
    datasets_dir: Optional[Path] = typer.Option(None, help="Directory with the gsm8k/ and humaneval/ development subsets: measured in the held-out report, never trained on."),
    data_dir: Optional[Path] = typer.Option(None, help="Where generated self-distillation shards go (resumable). Default: OUT/data."),
    max_prompts: int = typer.Option(0, help="Use only the first N training prompts of --prompts or the built-in set (0: all); --extra-prompts and --generation-prompts count apart.", min=0),
    max_prompt_tokens: int = typer.Option(400, help="Skip prompts longer than this (tokens).", min=1),
    max_new_tokens: int = typer.Option(256, help="Response length cap for data generation (tokens).", min=2),
    gen_batch_size: int = typer.Option(48, help="Sequences decoded together during data generation.", min=1),
    gen_dtype: str = typer.Option("float32", help="Base-model dtype for data generation: float32 or bfloat16 (with --gen-with model about 2x faster on AMX CPUs; with --gen-with engine bfloat16 leaves the GGUF/int8 path, so keep float32 there; responses can differ from float32 greedy ones late in a sequence).", metavar="[float32|bfloat16]"),
    gen_with: str = typer.Option("engine", help="What generates the data: 'engine', the serving engine with in-flight batching on the path it serves on (on CPU with --gen-dtype float32: the GGUF blocks with int8 decode activations, 3.5x the 'model' speed on an AVX2 CPU); 'model', the PyTorch model in --gen-dtype (how earlier drafters' data was made).", metavar="[engine|model]"),
    also_train_on: Optional[list[Path]] = typer.Option(None, help="Another shard directory to train on as well (data generated before by the same base model, e.g. with other settings); repeat the option for several.", metavar="DIR"),
    extra_prompts: int = typer.Option(0, help="Also generate data for up to N training prompts from rdserve's extra built-in sources (more chat instructions, template math word problems, Python standard-library functions), into DATA/extra.", min=0),
    generation_prompts: int = typer.Option(0, help="Also generate data for up to N training prompts of short-generation tasks written by us (a sentence from a set of concepts, a sentence about a topic, the concepts of a sentence, app and product reviews; workers/training/concept_prompts.py), into DATA/generation. Not limited by --max-prompts.", min=0),
    steps: int = typer.Option(3000, help="Optimizer steps.", min=1),
    init_from: Optional[Path] = typer.Option(None, help="Start from this drafter's weights (same architecture, or fewer residual blocks: the extra ones start as the identity; fine-tuning). The draft vocabulary is still chosen from the new data."),
    batch_size: int = typer.Option(128, help="Training examples per step.", min=1),
    lr: float = typer.Option(1e-3, help="Peak AdamW learning rate (cosine decay)."),
    num_draft_layers: int = typer.Option(2, help="Residual blocks in the draft head.", min=0),
    head_type: str = typer.Option("shared", help="'shared': a 2H->H projection followed by the base model's LM head (small); 'full': a 2H->vocabulary output layer, the layout of Apple's ml-recurrent-drafter checkpoints.", metavar="[shared|full]"),
    draft_len: int = typer.Option(4, help="Drafted positions trained per example (K).", min=1),
    soft_weight: float = typer.Option(1.0, help="Weight of the base model's distribution as a target (0: its greedy tokens only, 1: its distribution only; the committed SmolLM2 drafter used 1).", min=0.0, max=1.0),
    draft_vocab_size: int = typer.Option(8192, help="Draft only the most frequent tokens of the training targets (0: whole vocabulary).", min=0),
    eval_prompts: int = typer.Option(24, help="Held-out prompts for the final tokens-per-step report (0: skip).", min=0),
    num_beams: int = typer.Option(4, help="Beams drafted per step in the held-out report.", min=1),
    draft_len_per_beam: int = typer.Option(4, help="Tokens drafted per beam in the held-out report.", min=1),
) -> None:
    """Self-distillation: the base model answers the prompts (greedy), and the drafter learns to
    predict its next tokens from its hidden states. Every stage resumes where it stopped."""
    if gen_dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter(f"must be float32 or bfloat16, got {gen_dtype!r}", param_hint="--gen-dtype")
    if gen_with not in ("engine", "model"):
        raise typer.BadParameter(f"must be engine or model, got {gen_with!r}", param_hint="--gen-with")
    for extra_dir in also_train_on or []:
        if not extra_dir.is_dir():
            raise typer.BadParameter(f"{extra_dir} does not exist", param_hint="--also-train-on")
        if not any(extra_dir.rglob("shard-*.pt")):
            raise typer.BadParameter(f"{extra_dir} holds no shard-*.pt files", param_hint="--also-train-on")
    if head_type not in ("shared", "full"):
        raise typer.BadParameter(f"must be shared or full, got {head_type!r}", param_hint="--head-type")
    if lr <= 0:
        raise typer.BadParameter(f"must be > 0, got {lr}", param_hint="--lr")
    if init_from is not None:  # checked now, not after hours of data generation
        check_init_from(init_from, head_type, num_draft_layers)
    import torch

    from workers.engine_builder import load_engine
    from workers.models.loader import load_model
    from workers.models.pull import pull_default
    from workers.models.tokenizer import apply_chat_template, load_tokenizer
    from workers.training.distill_data import generate_dataset
    from workers.training.concept_prompts import concept_prompts
    from workers.training.extra_prompts import extra_prompts as all_extra_prompts
    from workers.training.evaluate import tokens_per_step_by_category
    from workers.training.prompt_sources import build_prompts, split_of
    from workers.training.train import load_examples, train_drafter

    logging.basicConfig(level=logging.INFO)
    model_dir = model or pull_default()
    base = load_model(model_dir)
    tok = load_tokenizer(model_dir)
    if init_from is not None:
        check_same_base(init_from / "config.json", base.config, "--init-from")
    data = data_dir or out / "data"
    check_also_train_on(also_train_on or [], data, Path(model_dir))
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
    if gen_with == "engine":
        gen_model = load_engine(str(model_dir), None, dtype=gen_dtype, max_batch_size=gen_batch_size,
                           max_seq_len=max(16, max_prompt_tokens + max_new_tokens + 1), decode_activations="auto")
        gen_with = f"engine:{gen_model.compute_path}"
    else:
        gen_model = base if gen_dtype == "float32" else load_model(model_dir, dtype=getattr(torch, gen_dtype))
    settings = {"model": str(Path(model_dir).resolve()), "max_new_tokens": max_new_tokens, "gen_dtype": gen_dtype,
                "max_prompt_tokens": max_prompt_tokens, "gen_with": gen_with}
    check_data_settings(data, settings)
    console.print(f"[bold]1/3[/] self-distillation data for {len(train_rows)} prompts in {data} (existing shards "
                  f"are kept), generated by the {gen_with.replace(':', ' on ')}")
    generate_dataset(gen_model, train_rows, data, max_new_tokens, gen_batch_size, eos)
    built_in = [(extra_prompts, "extra", lambda: all_extra_prompts()),
                (generation_prompts, "generation", lambda: concept_prompts(generation_prompts))]
    for count, name, source in built_in:
        if count == 0:
            continue
        rows = [r for r in source() if split_of(r["messages"][0]["content"]) == "train"]
        for r in rows:
            r["prompt_ids"] = apply_chat_template(tok, r["messages"])
        rows = [r for r in rows if len(r["prompt_ids"]) <= max_prompt_tokens][:count]
        console.print(f"[bold]1/3[/] self-distillation data for {len(rows)} {name} prompts in {data / name}")
        generate_dataset(gen_model, rows, data / name, max_new_tokens, gen_batch_size, eos)
    del gen_model
    console.print("[bold]2/3[/] training")
    dirs = [d for d in [data] if any(d.rglob("shard-*.pt"))] + list(also_train_on or [])
    if not dirs:
        raise typer.BadParameter(f"no training data: no usable prompt (after --max-prompt-tokens {max_prompt_tokens}) "
                                 f"and no --also-train-on", param_hint="--prompts")
    examples = load_examples(dirs, draft_len)
    report = train_drafter(base, examples, out, num_draft_layers=num_draft_layers, head_type=head_type,
                           steps=steps, batch_size=batch_size, lr=lr,
                           draft_vocab_size=draft_vocab_size, soft_weight=soft_weight, init_from=init_from)
    report["data"] = {**settings, "dir": str(data.resolve()), "also_train_on": [str(d.resolve()) for d in also_train_on or []]}
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    if eval_prompts > 0 and held_rows:
        console.print(f"[bold]3/3[/] held-out tokens per step on up to {eval_prompts} prompts")
        del base
        engine = load_engine(str(model_dir), str(out), num_beams=num_beams, draft_len_per_beam=draft_len_per_beam)
        report["heldout_tokens_per_step"] = tokens_per_step_by_category(engine, _balanced(held_rows, eval_prompts), 128)
        report["heldout_beam_shape"] = {"num_beams": num_beams, "draft_len_per_beam": draft_len_per_beam}
        (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
        table = Table("category", "prompts", "tokens/step")
        for cat, row in report["heldout_tokens_per_step"].items():
            table.add_row(cat, str(row["prompts"]), f"{row['tokens_per_step']:.2f}")
        console.print(table)
    (out / "checkpoint.pt").unlink(missing_ok=True)
    console.print(f"drafter written to {out}")


def _per_category(rows: list[dict], n: int) -> list[dict]:
    """The first ``n`` rows of each category (all rows with ``n`` 0), in file order."""
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        c = r.get("category", "unknown")
        if not n or seen.get(c, 0) < n:
            seen[c] = seen.get(c, 0) + 1
            out.append(r)
    return out


def _shapes(text: str) -> list[tuple[int, int]]:
    from workers.speculation.shape import DraftShape

    try:
        return DraftShape.parse_list(text)
    except ValueError as err:
        raise typer.BadParameter(f"{err} (num_beams x draft_len_per_beam)", param_hint="--shapes") from None


@drafter_app.command("interpolate")
def interpolate(
    first: Path = typer.Option(..., help="Drafter directory weighted 1 - WEIGHT (e.g. the head a fine-tune started from)."),
    second: Path = typer.Option(..., help="Drafter directory weighted WEIGHT (e.g. the fine-tuned head); same architecture."),
    weight: float = typer.Option(..., help="Weight of --second, in [0, 1].", min=0.0, max=1.0),
    out: Path = typer.Option(..., help="Output drafter directory (config.json, model.safetensors, draft_vocab.json, interpolation.json)."),
) -> None:
    """Average two draft heads weight by weight (WiSE-FT): (1 - WEIGHT) * FIRST + WEIGHT * SECOND,
    with the union of their draft vocabularies. A fine-tuned head averaged with its start keeps more
    of what the start knew (the committed drafter's card shows the trade-off)."""
    from workers.training.interpolate import interpolate_drafters

    if weight != weight:  # NaN passes typer's range check
        raise typer.BadParameter("must be a number in [0, 1], got nan", param_hint="--weight")
    for option, path in (("--first", first), ("--second", second)):
        if out.resolve() == path.resolve():
            raise typer.BadParameter(f"is {option} ({path}); write the average to a new directory", param_hint="--out")
        if not (path / "config.json").is_file():
            raise typer.BadParameter(f"{path} is not a drafter directory (needs config.json and model.safetensors)",
                                     param_hint=option)
    try:
        record = interpolate_drafters(first, second, weight, out)
    except FileNotFoundError as e:
        raise typer.BadParameter(str(e)) from None
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--second") from None
    vocab = record["draft_vocab_size"]
    console.print(f"drafter written to {out} (draft vocabulary: "
                  f"{f'{vocab:,} tokens' if vocab is not None else 'the whole vocabulary'})")


@drafter_app.command("eval")
def evaluate(
    drafter: Path = typer.Option(..., help="Drafter directory (config.json, model.safetensors, draft_vocab.json)."),
    prompts: Path = typer.Option(..., help="JSONL prompts ('prompt' or 'messages', optional 'category'), e.g. ../shared/datasets/broad/dev.jsonl."),
    model: Optional[Path] = typer.Option(None, help="Base model HF directory; default: SmolLM2-135M-Instruct from the cache."),
    out: Path = typer.Option(Path("drafter-eval.json"), help="JSON report."),
    shapes: str = typer.Option("1x2", help="Beam shapes for speculative decoding, num_beams x draft_len_per_beam, comma-separated."),
    max_new_tokens: int = typer.Option(128, help="Output tokens per prompt (both measurements).", min=2),
    per_category: int = typer.Option(0, help="Speculative decoding on the first N prompts of each category (0: all). Teacher-forced accuracy always uses every prompt.", min=0),
    draft_len: int = typer.Option(4, help="Drafted positions scored teacher-forced (K).", min=1),
    data_dir: Optional[Path] = typer.Option(None, help="Cache of the base model's greedy responses to the prompts (float32; reused on a re-run). Default: next to --out."),
    spec: bool = typer.Option(True, help="Run speculative decoding (the served engine: the model's GGUF blocks where it has them, the drafter on Q8_0)."),
    prompt_lookup_num_tokens: int = typer.Option(0, help="Add a prompt-lookup beam of this many tokens to every draft tree (speculation.prompt_lookup_num_tokens; 0: ReDrafter beams only).", min=0),
    prompt_lookup_min: int = typer.Option(2, help="Shortest n-gram the prompt-lookup beam matches.", min=1),
    prompt_lookup_max: int = typer.Option(3, help="Longest n-gram the prompt-lookup beam matches.", min=1),
    draft_search: str = typer.Option("distinct_first", help="How the drafter's beams are chosen (speculation.draft_search): 'beam', ReDrafter's beam search; 'distinct_first', the num_beams most likely first tokens each continued greedily.", metavar="[beam|distinct_first]"),
    prompt_lookup_max_num_tokens: Optional[int] = typer.Option(None, help="Let the lookup beam double after a step that accepted all of it, up to this many tokens (speculation.prompt_lookup_max_num_tokens).", min=1),
) -> None:
    """Measure a drafter on a prompt set, per category: speculative decoding (tokens per step,
    first-token acceptance; with --prompt-lookup-num-tokens, of the ReDrafter beams plus a
    prompt-lookup beam) and teacher-forced top-1 accuracy per drafted position with the draft
    vocabulary's coverage. Greedy, batch 1; prompts over 2,000 tokens are skipped."""
    shape_list = _shapes(shapes)
    if draft_search not in ("beam", "distinct_first"):
        raise typer.BadParameter(f"must be beam or distinct_first, got {draft_search!r}", param_hint="--draft-search")
    if prompt_lookup_min > prompt_lookup_max:
        raise typer.BadParameter(f"{prompt_lookup_min} is above --prompt-lookup-max {prompt_lookup_max}",
                                 param_hint="--prompt-lookup-min")
    from workers.engine_builder import load_engine
    from workers.models.loader import load_model
    from workers.models.pull import pull_default
    from workers.models.tokenizer import apply_chat_template, load_tokenizer
    from workers.redrafter.drafter import load_drafter
    from workers.training.dev_eval import spec_acceptance, teacher_forced
    from workers.training.distill_data import generate_dataset
    from workers.training.train import load_examples

    rows = _read_prompts(prompts)
    model_dir = model or pull_default()
    base = load_model(model_dir)
    tok = load_tokenizer(model_dir)
    for r in rows:
        r["prompt_ids"] = apply_chat_template(tok, r["messages"]) if "messages" in r else tok(r["prompt"])["input_ids"]
    skipped = sum(len(r["prompt_ids"]) > 2000 for r in rows)
    rows = [r for r in rows if len(r["prompt_ids"]) <= 2000]
    if skipped:
        console.print(f"skipped {skipped} prompts over 2,000 tokens")
    report: dict = {"drafter": str(drafter), "prompts": str(prompts), "max_new_tokens": max_new_tokens,
                    "prompt_lookup": {"num_tokens": prompt_lookup_num_tokens, "min": prompt_lookup_min,
                                      "max": prompt_lookup_max, "max_num_tokens": prompt_lookup_max_num_tokens},
                    "draft_search": draft_search}
    data = data_dir or out.with_name(out.stem + "-data")
    check_data_settings(data, {"model": str(Path(model_dir).resolve()), "prompts": str(prompts.resolve()),
                                "max_new_tokens": max_new_tokens, "gen_dtype": "float32"})
    eos = set(base.config.eos_token_id) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    console.print(f"[bold]1/2[/] teacher-forced accuracy on {len(rows)} prompts (responses cached in {data})")
    generate_dataset(base, rows, data, max_new_tokens, 32, eos)
    head = load_drafter(drafter, base.lm_head.weight)
    report["teacher_forced"] = teacher_forced(head, base.model.embed_tokens.weight.detach(), load_examples(data, draft_len))
    del base, head
    table = Table("category", "positions", "vocab coverage", *[f"top-1 @{k + 1}" for k in range(draft_len)])
    for cat, row in report["teacher_forced"].items():
        table.add_row(cat, str(row["positions"]), f"{row['vocab_coverage']:.3f}", *[f"{a:.3f}" for a in row["top1_per_position"]])
    console.print(table)
    if spec:
        subset = _per_category(rows, per_category)
        report["spec"] = {}
        for nb, dl in shape_list:
            engine = load_engine(str(model_dir), str(drafter), num_beams=nb, draft_len_per_beam=dl,
                            prompt_lookup_num_tokens=prompt_lookup_num_tokens, prompt_lookup_min=prompt_lookup_min,
                            prompt_lookup_max=prompt_lookup_max,
                            prompt_lookup_max_num_tokens=prompt_lookup_max_num_tokens, draft_search=draft_search)
            res = spec_acceptance(engine, subset, max_new_tokens, desc=f"speculative {nb}x{dl}")
            report["spec"][f"{nb}x{dl}"] = res
            table = Table("category", "prompts", "tokens/step", "first-token acceptance", title=f"shape {nb}x{dl}")
            for cat, row in res.items():
                table.add_row(cat, str(row["prompts"]), f"{row['tokens_per_step']:.2f}", f"{row['first_token_acceptance']:.2f}")
            console.print(table)
            del engine
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"report written to {out}")
