"""Self-distillation training of a ReDrafter head (arXiv 2403.09919 Sec. 3.4, "knowledge
distillation" variant: targets are the base model's own greedy tokens).

Each training example is one response position ``i`` of a shard written by
:mod:`workers.training.distill_data`: context ``g_i`` (``[H]``), root token ``y_i``, and targets
``y_{i+1..i+K}``. The RNN runs over ``e(y_i), .., e(y_{i+K-1})`` with the base model's frozen
embedding; the loss is the mean cross-entropy over the K drafted positions. The base model's LM
head is frozen (``shared`` heads reuse it). Matrix products run in bfloat16 autocast on CPUs with
bfloat16 arithmetic (AMX or AVX512-BF16) and in float32 elsewhere, where bfloat16 is emulated and
slower than float32.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from workers.redrafter.drafter import DrafterConfig, ReDrafter


@dataclass
class TrainExamples:
    """Response positions of self-distillation shards.

    ``hiddens``: ``[P, H] float16``, every stored hidden state (``hiddens[j]`` chose the j-th
    response token of its record); ``ctx_idx``: ``[N] long``, the context ``g_i`` of each example
    in ``hiddens`` (the hidden that chose ``y_{i+k}`` is ``hiddens[ctx_idx + k]``); ``windows``:
    ``[N, K + 1] long`` (root then K targets, -100 padded); ``prompt_idx``: ``[N] long``, which
    prompt each example came from (records with the same prompt tokens share an index, even in
    different directories, so a held-out split by prompt never leaks an answer into training).
    """

    hiddens: torch.Tensor
    ctx_idx: torch.Tensor
    windows: torch.Tensor
    prompt_idx: torch.Tensor
    categories: list[str]

    @property
    def contexts(self) -> torch.Tensor:
        """``[N, H] float16`` contexts (a copy)."""
        return self.hiddens[self.ctx_idx]


def load_examples(shard_dir: Path | list[Path], draft_len: int) -> TrainExamples:
    """All response positions of all shards in ``shard_dir`` (or each of a list of directories)
    and their subdirectories.

    Raises:
        FileNotFoundError: when a directory holds no shard.
    """
    shards = []
    for d in shard_dir if isinstance(shard_dir, list) else [shard_dir]:
        found = sorted(Path(d).rglob("shard-*.pt"))
        if not found:
            raise FileNotFoundError(f"no shard-*.pt files in {d}")
        shards += found
    hiddens, ctx_idx, windows, prompt_idx, cats = [], [], [], [], []
    offset, prompt_ids = 0, {}
    for shard in tqdm(shards, desc="loading shards", unit="shard"):
        for rec in torch.load(shard, weights_only=False):
            ids = torch.tensor(rec["response_ids"])
            n = len(ids)
            if n < 2:
                continue
            padded = torch.cat([ids, torch.full((draft_len,), -100)])
            windows.append(padded.unfold(0, draft_len + 1, 1)[: n - 1])
            hiddens.append(rec["hiddens"][:n])
            ctx_idx.append(torch.arange(offset, offset + n - 1))
            idx = prompt_ids.setdefault(tuple(rec["prompt_ids"]), len(prompt_ids))
            prompt_idx.append(torch.full((n - 1,), idx))
            cats += [rec["category"]] * (n - 1)
            offset += n
    return TrainExamples(torch.cat(hiddens), torch.cat(ctx_idx), torch.cat(windows), torch.cat(prompt_idx), cats)


def drafter_loss(
    drafter: ReDrafter, embed: torch.Tensor, contexts: torch.Tensor, windows: torch.Tensor,
    to_draft: torch.Tensor | None = None, teacher_hiddens: torch.Tensor | None = None,
    teacher_head: torch.Tensor | None = None, soft_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean loss over drafted positions, and top-1 accuracy per position ``[K]``.

    contexts ``[B, H]``; windows ``[B, K + 1] long`` (-100 where past the end of a response).
    ``to_draft`` (``[V] long``) maps token ids to draft-vocabulary indices (-100 outside it) when
    the drafter's vocabulary is restricted; such targets count as misses and carry no hard loss.
    The loss is ``(1 - soft_weight) * CE(base token) + soft_weight * CE(base distribution)``;
    the base distribution at target ``k`` is ``softmax(teacher_head @ teacher_hiddens[:, k])``
    (``teacher_hiddens``: ``[B, K, H]``, ``teacher_head``: ``[Vd, H]`` over the drafter's
    vocabulary), i.e. the KL-to-the-base-model variant of Sec. 3.4 up to a constant.
    """
    K = windows.shape[1] - 1
    state = torch.zeros_like(contexts)
    losses, correct = [], []
    for k in range(K):
        inp = windows[:, k].clamp(min=0)
        state = drafter.step_state(state, F.embedding(inp, embed))
        logits = drafter.logits(contexts, state)
        target = windows[:, k + 1]
        valid = target >= 0
        if to_draft is not None:
            target = torch.where(valid, to_draft[target.clamp(min=0)], target)
        loss = F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
        if soft_weight > 0:
            with torch.no_grad():
                teacher = F.softmax(F.linear(teacher_hiddens[:, k], teacher_head).float(), dim=-1)
            soft = -(teacher * F.log_softmax(logits, dim=-1)).sum(-1)
            loss = (1 - soft_weight) * loss + soft_weight * (soft * valid).sum()
        losses.append(loss)
        hit = target >= 0
        correct.append(((logits.argmax(-1) == target) & hit).sum() / valid.sum().clamp(min=1))
    n = (windows[:, 1:] >= 0).sum().clamp(min=1)
    return torch.stack(losses).sum() / n, torch.stack(correct)


def _teacher_hiddens(examples: TrainExamples, idx: torch.Tensor, K: int) -> torch.Tensor:
    """``[B, K, H]``: the hidden states that chose targets 1..K of examples ``idx`` (any row
    where a target is past the end of its response is masked by the loss)."""
    pos = (examples.ctx_idx[idx, None] + torch.arange(1, K + 1)[None, :]).clamp(max=len(examples.hiddens) - 1)
    return examples.hiddens[pos].float()


def train_drafter(
    base_model,
    examples: TrainExamples,
    out_dir: Path,
    *,
    num_draft_layers: int = 2,
    head_type: str = "shared",
    steps: int = 2000,
    batch_size: int = 128,
    lr: float = 1e-3,
    heldout_fraction: float = 0.02,
    checkpoint_every: int = 200,
    seed: int = 0,
    draft_vocab_size: int = 8192,
    soft_weight: float = 0.0,
    init_from: Path | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> dict:
    """Train and save a drafter to ``out_dir``; resumes from ``out_dir/checkpoint.pt``.

    About ``heldout_fraction`` of the prompts (whole responses, chosen by a seeded draw) are kept
    out of training for the reported top-1 accuracy. ``soft_weight`` mixes in the base model's
    distribution as a target (see :func:`drafter_loss`). ``init_from``: a drafter directory of the
    same architecture whose weights start the training (fine-tuning; its draft vocabulary is not
    reused: the vocabulary is chosen from ``examples``). ``autocast_dtype``: None picks
    :func:`default_autocast_dtype`.

    Raises:
        ValueError: ``init_from`` holds a drafter of another architecture (names what differs).

    Returns a report dict (also written to ``out_dir/train_report.json``).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = base_model.config
    embed = base_model.model.embed_tokens.weight.detach()
    head = base_model.lm_head.weight.detach()
    drafter = ReDrafter(DrafterConfig(cfg.vocab_size, cfg.hidden_size, num_draft_layers, head_type), head)
    with torch.no_grad():
        for block in drafter.lm_head:
            if hasattr(block, "linear"):
                block.linear.weight.mul_(0.1)
        if head_type == "shared":  # start from the base head applied to the context: sane logit scale
            drafter.out_proj.weight.zero_()
            drafter.out_proj.weight[:, : cfg.hidden_size] = torch.eye(cfg.hidden_size)
    if init_from is not None:
        _load_initial_weights(drafter, Path(init_from), head)
    autocast_dtype = autocast_dtype or default_autocast_dtype()
    coverage, to_draft = None, None
    restrict = 0 < draft_vocab_size < cfg.vocab_size
    if restrict:
        vocab, coverage = frequent_tokens(examples.windows[:, 1:], cfg.vocab_size, draft_vocab_size)
    if restrict and head_type == "shared":  # train on the draft vocabulary (the frozen base head's rows)
        drafter.restrict_vocab(vocab)
        to_draft = torch.full((cfg.vocab_size,), -100, dtype=torch.long)
        to_draft[vocab] = torch.arange(len(vocab))
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    teacher_head = head if to_draft is None else head[vocab]
    n_prompts = int(examples.prompt_idx.max()) + 1
    held_prompts = torch.rand(n_prompts, generator=torch.Generator().manual_seed(seed)) < heldout_fraction
    held_prompts[0] |= not held_prompts.any()  # always measure on at least one prompt
    is_held = held_prompts[examples.prompt_idx]
    held, train_idx = is_held.nonzero()[:, 0], (~is_held).nonzero()[:, 0]
    K = examples.windows.shape[1] - 1

    def loss_of(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        teacher = _teacher_hiddens(examples, idx, K) if soft_weight > 0 else None
        return drafter_loss(drafter, embed, examples.hiddens[examples.ctx_idx[idx]].float(), examples.windows[idx],
                            to_draft, teacher, teacher_head, soft_weight)
    ckpt = out_dir / "checkpoint.pt"
    start, elapsed = 0, 0.0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start, elapsed = state["step"], state["elapsed_s"]
    rng = random.Random(seed + start)
    bar = tqdm(range(start, steps), desc="drafter training", initial=start, total=steps, unit="step")
    t0 = time.perf_counter()
    for step in bar:
        idx = train_idx[torch.tensor([rng.randrange(len(train_idx)) for _ in range(batch_size)])]
        with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype != torch.float32):
            loss, acc = loss_of(idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", acc1=f"{acc[0].item():.2f}")
        if (step + 1) % checkpoint_every == 0 or step + 1 == steps:
            torch.save(
                {"drafter": drafter.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                 "step": step + 1, "elapsed_s": elapsed + time.perf_counter() - t0},
                ckpt,
            )
    elapsed += time.perf_counter() - t0
    drafter.eval()
    with torch.no_grad():
        accs = []
        for chunk in held.split(512):
            _, acc = loss_of(chunk)
            accs.append(acc)
        acc = torch.stack(accs).mean(0)
    if restrict and head_type == "full":
        drafter.restrict_vocab(vocab)
    drafter.save(out_dir)
    report = {
        "draft_vocab_size": draft_vocab_size if coverage is not None else cfg.vocab_size,
        "draft_vocab_coverage": coverage,
        "steps": steps, "batch_size": batch_size, "train_examples": len(train_idx), "heldout_examples": len(held),
        "train_time_s": round(elapsed, 1), "heldout_top1_accuracy_per_position": [round(a, 4) for a in acc.tolist()],
        "num_draft_layers": num_draft_layers, "head_type": head_type, "soft_weight": soft_weight,
        "heldout": "whole prompts", "autocast_dtype": str(autocast_dtype).removeprefix("torch."),
        "init_from": str(init_from) if init_from is not None else None,
    }
    (out_dir / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def default_autocast_dtype() -> torch.dtype:
    """bfloat16 where the CPU computes in it (``amx_bf16`` or ``avx512_bf16`` in ``/proc/cpuinfo``),
    else float32."""
    from workers.kernels.build import missing_cpu_flags

    bf16_flags = {"amx_bf16", "avx512_bf16"}
    return torch.bfloat16 if missing_cpu_flags(bf16_flags) != sorted(bf16_flags) else torch.float32


def _load_initial_weights(drafter: ReDrafter, path: Path, base_lm_head: torch.Tensor) -> None:
    """Copy the trainable weights of the drafter saved at ``path`` into ``drafter``.

    A saved head with fewer residual blocks grows: its blocks come first and each extra block
    starts with zero weights and bias, so ``x + SiLU(0 x + 0) = x`` and training starts from the
    saved head's exact predictions (a capacity lever measured at equal data and steps).

    Raises:
        ValueError: another head type, hidden size or vocabulary, or more residual blocks (names it).
    """
    from workers.redrafter.drafter import load_drafter

    init = load_drafter(path, base_lm_head)
    for field in ("hidden_size", "num_draft_layers", "head_type", "vocab_size"):
        mine, theirs = getattr(drafter.config, field), getattr(init.config, field)
        if mine != theirs and not (field == "num_draft_layers" and theirs < mine):
            raise ValueError(f"--init-from {path}: {field} is {theirs}, the drafter being trained has {mine}")
    params = dict(drafter.named_parameters())
    n_init, n_mine = init.config.num_draft_layers, drafter.config.num_draft_layers
    state = init.state_dict()
    if n_init < n_mine:
        if init.config.head_type == "full":  # the vocabulary layer follows the blocks in lm_head
            state[f"lm_head.{n_mine}.weight"] = state.pop(f"lm_head.{n_init}.weight")
        for i in range(n_init, n_mine):
            state[f"lm_head.{i}.linear.weight"] = torch.zeros_like(params[f"lm_head.{i}.linear.weight"])
            state[f"lm_head.{i}.linear.bias"] = torch.zeros_like(params[f"lm_head.{i}.linear.bias"])
    wanted = {k: v for k, v in state.items() if k in params and v.shape == params[k].shape}
    missing = [k for k, p in params.items() if p.requires_grad and k not in wanted]
    if missing:
        raise ValueError(f"--init-from {path}: no weights for {', '.join(missing)}")
    drafter.load_state_dict(wanted, strict=False)


def frequent_tokens(targets: torch.Tensor, vocab_size: int, k: int) -> tuple[torch.Tensor, float]:
    """The ``k`` most frequent target tokens (sorted ids) and the fraction of targets they cover."""
    valid = targets[targets >= 0]
    counts = torch.bincount(valid, minlength=vocab_size)
    top = counts.topk(k).indices
    return top.sort().values, round(counts[top].sum().item() / max(1, valid.numel()), 4)
