from workers.training.prompt_sources import build_prompts, first_per_category, split_of


def test_first_per_category_keeps_order_and_caps_each_category():
    rows = [{"category": c, "i": i} for i, c in enumerate("abacbbca")]
    got = first_per_category(rows, 2)
    assert list(got) == ["a", "b", "c"]
    assert {c: [r["i"] for r in v] for c, v in got.items()} == {"a": [0, 2], "b": [1, 4], "c": [3, 6]}


def test_train_and_heldout_splits_are_disjoint_and_stable():
    train = {p["messages"][0]["content"] for p in build_prompts(None, "train")}
    held = {p["messages"][0]["content"] for p in build_prompts(None, "heldout")}
    assert train and held and not (train & held)
    assert all(split_of(t) == "heldout" for t in held)


def test_extra_prompts_are_new_and_cover_every_category():
    from workers.training.extra_prompts import extra_prompts

    extra = extra_prompts()
    texts = [p["messages"][0]["content"] for p in extra]
    base = {p["messages"][0]["content"] for split in ("train", "heldout") for p in build_prompts(None, split)}
    assert len(set(texts)) == len(texts) and not (set(texts) & base)
    counts = {c: sum(p["category"] == c for p in extra) for c in ("chat", "code", "math")}
    assert min(counts.values()) >= 1000, counts
    assert extra == extra_prompts()  # stable order: generation resumes by position
    assert all(t.strip() for t in texts)


def test_development_sets_are_never_trained_on(tmp_path):
    import json

    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "humaneval").mkdir()
    (tmp_path / "gsm8k" / "gsm8k_dev.jsonl").write_text(
        "".join(json.dumps({"question": f"How many apples, case {i}?"}) + "\n" for i in range(40)))
    (tmp_path / "humaneval" / "humaneval_dev.jsonl").write_text(
        "".join(json.dumps({"prompt": f"def f{i}(x):\n"}) + "\n" for i in range(40)))
    train = " ".join(p["messages"][0]["content"] for p in build_prompts(tmp_path, "train"))
    held = [p["category"] for p in build_prompts(tmp_path, "heldout")]
    assert "apples" not in train and "def f1(" not in train
    assert held.count("math") == 40 and held.count("code") >= 40  # every dev prompt is measured
