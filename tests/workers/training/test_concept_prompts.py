"""Short-generation prompts: many distinct texts, one category, split by the shared stable hash."""

import pytest

from workers.training.concept_prompts import concept_prompts
from workers.training.prompt_sources import split_of


def test_train_prompts_are_distinct_generation_prompts_of_the_train_split():
    rows = concept_prompts(1500)
    texts = [r["messages"][0]["content"] for r in rows]
    assert len(texts) == len(set(texts)) == 1500
    assert {r["category"] for r in rows} == {"generation"}
    assert all(split_of(t) == "train" for t in texts)
    from workers.training.concept_prompts import NOUNS, VERBS

    assert not set(NOUNS) & set(VERBS)  # a concept set never names one word twice
    kinds = ["uses all of these words", "Write a sentence about", "concepts in this sentence", "-star review"]
    assert all(any(k in t for t in texts) for k in kinds)  # each kind of task is there


def test_the_splits_never_share_a_prompt_and_a_seed_repeats():
    train = {r["messages"][0]["content"] for r in concept_prompts(800)}
    held = [r["messages"][0]["content"] for r in concept_prompts(60, split="heldout")]
    assert len(held) == 60 and not train & set(held)
    assert concept_prompts(50, seed=3) == concept_prompts(50, seed=3) != concept_prompts(50, seed=4)


def test_an_unknown_split_is_refused():
    with pytest.raises(ValueError, match="split must be"):
        concept_prompts(10, split="dev")
