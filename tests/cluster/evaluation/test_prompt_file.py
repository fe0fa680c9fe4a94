"""Prompt files are JSON Lines: one JSON value per "\n"-terminated line. Unicode line separators
inside strings (U+2028, U+0085 ..., which ``str.splitlines`` splits on) belong to the string:
``shared/datasets/broad/train.jsonl`` has seven of them."""

import json

import pytest

from cluster.evaluation.prompts import PromptFileError, load_prompts

TEXTS = ["first line\u2028second line", "a\x85b\x0cc", "plain"]


def test_unicode_line_separators_inside_strings_do_not_split_rows(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\n" for t in TEXTS))
    rows = load_prompts(path)
    assert [r.prompt for r in rows] == TEXTS


def test_invalid_json_names_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n{broken\n")
    with pytest.raises(PromptFileError, match=r"p.jsonl:2: invalid JSON"):
        load_prompts(path)


def test_drafter_training_reads_the_same_files(tmp_path):
    from workers.training.cli import _read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\n" for t in TEXTS))
    assert [r["prompt"] for r in _read_prompts(path)] == TEXTS
