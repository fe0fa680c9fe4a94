"""Self-distillation examples and losses on a tiny random model: the teacher hidden states line up
with the tokens they chose, held-out prompts are whole prompts, and the soft (distribution)
target trains a drafter as well as the hard one."""

from __future__ import annotations

import random

import pytest
import torch

from workers.models.loader import load_model
from workers.training.distill_data import generate_dataset
from workers.training.train import _teacher_hiddens, load_examples, train_drafter

K = 3


@pytest.fixture(scope="module")
def distilled(tiny_model_dirs, tmp_path_factory):
    model_dir = tiny_model_dirs["tied_gqa2"]
    base = load_model(model_dir)
    rng = random.Random(0)
    prompts = [{"prompt_ids": [rng.randrange(3, base.config.vocab_size) for _ in range(rng.randint(1, 20))]}
               for _ in range(64)]
    root = tmp_path_factory.mktemp("distill")
    generate_dataset(base, prompts[:40], root, 24, batch_size=16, eos_ids=set(base.config.eos_token_id))
    generate_dataset(base, prompts[40:], root / "extra", 24, batch_size=16, eos_ids=set(base.config.eos_token_id))
    return base, load_examples(root, draft_len=K), root


def test_examples_come_from_every_shard_directory(distilled):
    _, ex, root = distilled
    records = [r for p in sorted(root.rglob("shard-*.pt")) for r in torch.load(p, weights_only=False)]
    assert len(records) == 64
    usable = [r for r in records if len(r["response_ids"]) >= 2]  # one token gives no training example
    assert int(ex.prompt_idx.max()) + 1 == len(usable) and len(ex.ctx_idx) == sum(len(r["response_ids"]) - 1 for r in usable)


def test_a_prompt_in_two_directories_is_one_prompt(distilled, tmp_path):
    """The held-out split draws whole prompts: the same prompt's records in two directories share
    one prompt index, so its answer cannot be both trained on and held out."""
    _, ex, root = distilled
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in (root / "extra").glob("shard-*.pt"):
        (copy / p.name).write_bytes(p.read_bytes())
    both = load_examples([root, copy], draft_len=K)
    assert len(both.ctx_idx) > len(ex.ctx_idx)
    assert int(both.prompt_idx.max()) == int(ex.prompt_idx.max())
    assert torch.equal(both.prompt_idx[: len(ex.prompt_idx)], ex.prompt_idx)


def test_teacher_hiddens_are_the_records_hiddens(distilled):
    """Example i of a record with hiddens g: context g[i], teacher k = g[i + k] (random tiny models
    repeat tokens, so argmax agreement alone would not catch an off-by-one)."""
    _, ex, root = distilled
    teacher = _teacher_hiddens(ex, torch.arange(len(ex.ctx_idx)), K)
    e = 0
    for path in sorted(root.rglob("shard-*.pt")):
        for rec in torch.load(path, weights_only=False):
            n = len(rec["response_ids"])
            if n < 2:
                continue
            g = rec["hiddens"].float()
            assert torch.equal(ex.contexts[e : e + n - 1].float(), g[: n - 1])
            for k in range(1, K + 1):
                assert torch.equal(teacher[e : e + n - k, k - 1], g[k:n])
            e += n - 1
    assert e == len(ex.ctx_idx)


def test_teacher_hiddens_chose_the_target_tokens(distilled):
    """hiddens[ctx_idx + k] is the state whose argmax is target k: greedy data makes them agree."""
    base, ex, _ = distilled
    idx = torch.arange(len(ex.ctx_idx))
    teacher = _teacher_hiddens(ex, idx, K)  # [N, K, H]
    with torch.no_grad():
        chosen = base.logits(teacher.reshape(-1, teacher.shape[-1])).argmax(-1).reshape(len(idx), K)
    targets = ex.windows[:, 1:]
    valid = targets >= 0
    agree = (chosen == targets)[valid].float().mean().item()
    assert agree > 0.98  # stored in float16, so a rare near-tie may flip
    # the root token (window column 0) was chosen by the context itself
    with torch.no_grad():
        root = base.logits(ex.contexts.float()).argmax(-1)
    assert (root == ex.windows[:, 0]).float().mean().item() > 0.98


def test_distribution_targets_generalise_better_than_tokens_on_little_data(distilled, tmp_path):
    """On ~50 prompts, hard targets overfit (the drafter starts as the base head on the context,
    which random tiny models make a strong guess, and drifts away); the base distribution carries
    more information per position and keeps held-out accuracy up. A wrong teacher index would
    make the soft target worse than the hard one."""
    base, ex, _ = distilled
    kw = dict(steps=300, lr=3e-3, checkpoint_every=10**9, draft_vocab_size=0, heldout_fraction=0.2, batch_size=64)
    hard = train_drafter(base, ex, tmp_path / "hard", soft_weight=0.0, **kw)
    soft = train_drafter(base, ex, tmp_path / "soft", soft_weight=1.0, **kw)
    assert soft["heldout"] == "whole prompts" and soft["soft_weight"] == 1.0
    assert 0 < soft["heldout_examples"] < len(ex.ctx_idx) / 2
    h, s = hard["heldout_top1_accuracy_per_position"], soft["heldout_top1_accuracy_per_position"]
    assert all(a > b + 0.15 for a, b in zip(s, h)), (h, s)


def test_init_from_starts_at_the_given_drafters_weights(distilled, tmp_path):
    """Fine-tuning (``--init-from``): with a vanishing learning rate the result is the initial
    drafter, whatever draft vocabulary the new data picks; a fresh start is not."""
    from safetensors.torch import load_file

    base, ex, _ = distilled
    kw = dict(checkpoint_every=10**9, heldout_fraction=0.2, batch_size=32, soft_weight=1.0)
    first = train_drafter(base, ex, tmp_path / "first", steps=60, lr=3e-3, draft_vocab_size=0, **kw)
    tuned = train_drafter(base, ex, tmp_path / "tuned", steps=1, lr=1e-12, draft_vocab_size=40,
                          init_from=tmp_path / "first", **kw)
    fresh = train_drafter(base, ex, tmp_path / "fresh", steps=1, lr=1e-12, draft_vocab_size=40, **kw)
    a, b, c = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("first", "tuned", "fresh"))
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert not all(torch.allclose(a[k], c[k], atol=1e-3) for k in a)
    assert tuned["init_from"] == str(tmp_path / "first") and first["init_from"] is None
    assert tuned["heldout_top1_accuracy_per_position"] != fresh["heldout_top1_accuracy_per_position"]


def test_init_from_another_architecture_names_what_differs(distilled, tmp_path):
    base, ex, _ = distilled
    kw = dict(steps=1, checkpoint_every=10**9, batch_size=8, draft_vocab_size=0)
    train_drafter(base, ex, tmp_path / "two_blocks", num_draft_layers=2, **kw)
    with pytest.raises(ValueError, match="num_draft_layers is 2, the drafter being trained has 1"):
        train_drafter(base, ex, tmp_path / "one_block", num_draft_layers=1, init_from=tmp_path / "two_blocks", **kw)
    with pytest.raises(ValueError, match="head_type is shared, the drafter being trained has full"):
        train_drafter(base, ex, tmp_path / "full", head_type="full", init_from=tmp_path / "two_blocks", **kw)


@pytest.mark.parametrize("head_type", ["shared", "full"])
def test_init_from_fewer_blocks_grows_a_head_that_predicts_the_same(distilled, tmp_path, head_type):
    """A head grown from one with fewer residual blocks starts as that head: the extra blocks are
    the identity, so (with a vanishing learning rate) the logits are the same; then they train."""
    from workers.redrafter.drafter import load_drafter

    base, ex, _ = distilled
    kw = dict(checkpoint_every=10**9, batch_size=32, draft_vocab_size=0, head_type=head_type, soft_weight=1.0)
    train_drafter(base, ex, tmp_path / "one", num_draft_layers=1, steps=40, lr=3e-3, **kw)
    train_drafter(base, ex, tmp_path / "grown", num_draft_layers=3, steps=1, lr=1e-12,
                  init_from=tmp_path / "one", **kw)
    trained = train_drafter(base, ex, tmp_path / "trained", num_draft_layers=3, steps=20, lr=3e-3,
                            init_from=tmp_path / "one", **kw)
    one, grown, moved = (load_drafter(tmp_path / d, base.lm_head.weight) for d in ("one", "grown", "trained"))
    assert grown.config.num_draft_layers == 3 and trained["num_draft_layers"] == 3
    H = base.config.hidden_size
    ctx, state = torch.randn(5, H), torch.randn(5, H)
    torch.testing.assert_close(grown.logits(ctx, state), one.logits(ctx, state), atol=1e-4, rtol=1e-4)
    assert moved.lm_head[2].linear.weight.abs().max() > 0  # the new blocks learn


def test_train_cli_checks_init_from_before_generating_data(tmp_path, trained_drafter_dirs):
    """A wrong --init-from fails at once with an error naming the option, not after data generation."""
    from typer.testing import CliRunner

    from cluster.cli.main import app

    drafter = trained_drafter_dirs["tied_gqa2"]
    base = ["drafter", "train", "--out", str(tmp_path / "out"), "--data-dir", str(tmp_path / "never")]
    missing = CliRunner().invoke(app, base + ["--init-from", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "is not a drafter directory" in missing.output
    other = CliRunner().invoke(app, base + ["--init-from", str(drafter), "--num-draft-layers", "1"])
    assert other.exit_code == 2 and "num_draft_layers" in other.output and "--init-from" in other.output
    assert not (tmp_path / "never").exists()
