"""Weight-space interpolation of two draft heads (``rdserve drafter interpolate``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from cluster.cli.main import app
from workers.redrafter.drafter import DrafterConfig, ReDrafter, load_drafter
from workers.training.interpolate import interpolate_drafters


def _head(path, seed, layers=2, vocab=None):
    torch.manual_seed(seed)
    lm_head = torch.randn(50, 16, generator=torch.Generator().manual_seed(0))
    d = ReDrafter(DrafterConfig(50, 16, layers, "shared"), lm_head)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.3)
    if vocab is not None:
        d.restrict_vocab(torch.tensor(vocab))
    d.save(path)
    return lm_head


def test_weights_are_the_weighted_average_and_vocabularies_unite(tmp_path):
    lm_head = _head(tmp_path / "a", 1, vocab=[1, 2, 3, 10])
    _head(tmp_path / "b", 2, vocab=[3, 4, 40])
    record = interpolate_drafters(tmp_path / "a", tmp_path / "b", 0.3, tmp_path / "m")
    a, b, m = (load_file(str(tmp_path / d / "model.safetensors")) for d in "abm")
    assert set(m) == set(a)
    for k in a:
        torch.testing.assert_close(m[k], 0.7 * a[k] + 0.3 * b[k])
    assert json.loads((tmp_path / "m" / "draft_vocab.json").read_text()) == [1, 2, 3, 4, 10, 40]
    assert record["draft_vocab_size"] == 6 and record["weight_of_second"] == 0.3
    loaded = load_drafter(tmp_path / "m", lm_head)  # loads as a drafter, restricted to the union
    assert loaded.draft_vocab.tolist() == [1, 2, 3, 4, 10, 40]
    ends = interpolate_drafters(tmp_path / "a", tmp_path / "b", 0.0, tmp_path / "w0")
    assert ends["weight_of_second"] == 0.0
    w0 = load_file(str(tmp_path / "w0" / "model.safetensors"))
    assert all(torch.equal(w0[k], a[k]) for k in a)


def test_whole_vocabulary_when_either_head_has_no_draft_vocabulary(tmp_path):
    _head(tmp_path / "a", 1, vocab=[1, 2])
    _head(tmp_path / "b", 2)
    assert interpolate_drafters(tmp_path / "a", tmp_path / "b", 0.5, tmp_path / "m")["draft_vocab_size"] is None
    assert not (tmp_path / "m" / "draft_vocab.json").exists()


def test_cli_refuses_other_architectures_and_bad_weights_naming_the_option(tmp_path):
    _head(tmp_path / "a", 1)
    _head(tmp_path / "b", 2, layers=3)
    args = ["drafter", "interpolate", "--first", str(tmp_path / "a"), "--out", str(tmp_path / "m")]
    other = CliRunner().invoke(app, args + ["--second", str(tmp_path / "b"), "--weight", "0.5"])
    assert other.exit_code == 2 and "num_draft_layers differs" in other.output
    bad = CliRunner().invoke(app, args + ["--second", str(tmp_path / "a"), "--weight", "1.5"])
    assert bad.exit_code == 2 and "--weight" in bad.output
    missing = CliRunner().invoke(app, args + ["--second", str(tmp_path / "nowhere"), "--weight", "0.5"])
    assert missing.exit_code == 2 and "not a drafter directory" in missing.output
    assert not (tmp_path / "m").exists()
    ok = CliRunner().invoke(app, args + ["--second", str(tmp_path / "a"), "--weight", "0.5"])
    assert ok.exit_code == 0 and "whole" in ok.output


def test_an_apple_config_without_head_type_is_a_full_head(tmp_path):
    """Apple's checkpoints' config.json has no head_type (load_drafter reads them as full heads)."""
    for name, seed in (("apple", 1), ("ours", 2)):
        torch.manual_seed(seed)
        ReDrafter(DrafterConfig(50, 16, 2, "full")).save(tmp_path / name)
    cfg = json.loads((tmp_path / "apple" / "config.json").read_text())
    del cfg["head_type"]
    (tmp_path / "apple" / "config.json").write_text(json.dumps(cfg))
    interpolate_drafters(tmp_path / "apple", tmp_path / "ours", 0.5, tmp_path / "m")
    assert load_drafter(tmp_path / "m", None).config.head_type == "full"
