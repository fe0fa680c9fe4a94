"""``rdserve drafter train`` / ``interpolate`` refuse what would waste hours or corrupt data, before any work."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cluster.cli.main import app


@pytest.fixture
def prompt_file(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"hello number {i} says", "category": "c"}) + "\n" for i in range(12)))
    return p


def _train(model_dir, prompts, out, *extra):
    return CliRunner().invoke(app, ["drafter", "train", "--out", str(out), "--model", str(model_dir), "--prompts",
                                    str(prompts), "--max-new-tokens", "6", "--gen-batch-size", "4", "--steps", "2",
                                    "--batch-size", "8", "--eval-prompts", "0", "--draft-vocab-size", "0", *extra])


def test_also_train_on_refuses_overlaps_eval_caches_and_other_models(tiny_model_dirs, tmp_path, prompt_file):
    model = tiny_model_dirs["tied_gqa2"]
    first = _train(model, prompt_file, tmp_path / "a")
    assert first.exit_code == 0, first.output
    data = tmp_path / "a" / "data"
    same = _train(model, prompt_file, tmp_path / "b", "--data-dir", str(data), "--also-train-on", str(data))
    assert same.exit_code == 2 and "overlaps" in same.output and "--also-train-on" in same.output
    nested = _train(model, prompt_file, tmp_path / "b", "--data-dir", str(tmp_path / "a"), "--also-train-on", str(data))
    assert nested.exit_code == 2 and "overlaps" in nested.output
    settings = json.loads((data / "generation.json").read_text())
    (data / "generation.json").write_text(json.dumps({**settings, "prompts": "/x/dev.jsonl"}))
    cache = _train(model, prompt_file, tmp_path / "c", "--also-train-on", str(data))
    assert cache.exit_code == 2 and "drafter eval" in cache.output
    (data / "generation.json").write_text(json.dumps({**settings, "model": "/elsewhere/model"}))
    other = _train(model, prompt_file, tmp_path / "d", "--also-train-on", str(data))
    assert other.exit_code == 2 and "/elsewhere/model" in other.output
    for out in "bcd":
        assert not (tmp_path / out / "data").exists()  # nothing generated
    (data / "generation.json").write_text(json.dumps(settings))
    # no usable prompt of its own (all over --max-prompt-tokens): trains on the other directory alone
    alone = _train(model, prompt_file, tmp_path / "e", "--also-train-on", str(data), "--max-prompt-tokens", "1")
    assert alone.exit_code == 0, alone.output
    report = json.loads((tmp_path / "e" / "train_report.json").read_text())
    assert report["data"]["also_train_on"] == [str(data.resolve())]
    nothing = _train(model, prompt_file, tmp_path / "f", "--max-prompt-tokens", "1")
    assert nothing.exit_code == 2 and "no training data" in nothing.output


def test_init_from_a_drafter_of_another_base_model_fails_before_generating(tiny_model_dirs, trained_drafter_dirs,
                                                                            tmp_path, prompt_file):
    drafter = trained_drafter_dirs["tied_gqa2"]
    cfg = json.loads((drafter / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**cfg, "hidden_size": cfg["hidden_size"] * 2}))
    (other / "model.safetensors").write_bytes((drafter / "model.safetensors").read_bytes())
    res = _train(tiny_model_dirs["tied_gqa2"], prompt_file, tmp_path / "o", "--init-from", str(other))
    assert res.exit_code == 2 and "--init-from" in res.output and "hidden_size" in res.output
    assert not (tmp_path / "o" / "data").exists()


def test_engine_data_from_another_compute_path_is_refused_naming_it(tiny_model_dirs, tmp_path, prompt_file):
    from workers.training.preflight import check_data_settings
    import typer

    settings = {"model": "/m", "max_new_tokens": 6, "gen_dtype": "float32", "max_prompt_tokens": 400}
    check_data_settings(tmp_path, {**settings, "gen_with": "engine:gguf-avx512-int8"})
    with pytest.raises(typer.BadParameter, match="compute path gguf-avx512-int8; here it runs gguf-avx2-int8") as err:
        check_data_settings(tmp_path, {**settings, "gen_with": "engine:gguf-avx2-int8"})
    assert err.value.param_hint == "--data-dir"


def test_interpolate_refuses_to_overwrite_an_input_and_nan(trained_drafter_dirs, tmp_path):
    import shutil

    a = tmp_path / "a"
    shutil.copytree(trained_drafter_dirs["tied_gqa2"], a, ignore=shutil.ignore_patterns("shards"))
    before = (a / "model.safetensors").read_bytes()
    base = ["drafter", "interpolate", "--first", str(a), "--second", str(a)]
    over = CliRunner().invoke(app, base + ["--weight", "0.5", "--out", str(a)])
    assert over.exit_code == 2 and "--out" in over.output and (a / "model.safetensors").read_bytes() == before
    nan = CliRunner().invoke(app, base + ["--weight", "nan", "--out", str(tmp_path / "m")])
    assert nan.exit_code == 2 and "--weight" in nan.output
    missing = CliRunner().invoke(app, ["drafter", "interpolate", "--first", str(a), "--second", str(tmp_path / "x"),
                                       "--weight", "0.5", "--out", str(tmp_path / "m")])
    assert missing.exit_code == 2 and "--second" in missing.output
    ok = CliRunner().invoke(app, base + ["--weight", "0.5", "--out", str(tmp_path / "m")])
    assert ok.exit_code == 0 and ("tokens)" in ok.output or "whole vocabulary" in ok.output), ok.output


def test_generation_prompts_add_short_generation_data_and_train_on_it(tiny_model_dirs, tmp_path, prompt_file):
    import torch

    res = _train(tiny_model_dirs["tied_gqa2"], prompt_file, tmp_path / "g", "--generation-prompts", "5",
                 "--max-prompt-tokens", "400")
    assert res.exit_code == 0, res.output
    records = [r for p in sorted((tmp_path / "g" / "data" / "generation").glob("shard-*.pt"))
               for r in torch.load(p, weights_only=False)]
    assert len(records) == 5 and {r["category"] for r in records} == {"generation"}
    assert "5 generation prompts" in " ".join(res.output.split())
