"""Prompt sources for self-distillation and evaluation, written as chat prompts with a category.

* ``math``: GSM8K questions (development subset in ``shared/datasets/gsm8k``; read, never copied).
* ``code``: HumanEval function stubs (``shared/datasets/humaneval``) and Python standard-library
  functions (``inspect.getsource`` of modules shipped with the interpreter).
* ``chat``: instructions composed from our own templates and topics.

A stable hash of the prompt text assigns each prompt to ``train`` or ``heldout`` (about 1 in 12
held out), so a drafter is never measured on prompts it was trained on.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import random
from pathlib import Path

CHAT_TEMPLATES = [
    "Explain {t} to a curious twelve-year-old.",
    "Write a short story about {t}.",
    "Give me five tips about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Write a haiku and then a limerick about {t}.",
    "Summarize the history of {t} in a few paragraphs.",
    "Write an email to a friend recommending {t}.",
    "Describe a typical day for someone who works with {t}.",
    "What are common misconceptions about {t}?",
    "Write a product description for something related to {t}.",
    "Compare {t} with something similar and explain the differences.",
    "Give a step-by-step guide for beginners interested in {t}.",
]
TOPICS = [
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the moon landing", "honey bees",
    "learning a new language", "electric cars", "solar power", "gardening", "baking bread", "chess",
    "the Roman Empire", "the printing press", "vaccines", "sleep", "running a marathon", "coffee",
    "recycling", "the internet", "airplanes", "dinosaurs", "the ocean", "rainforests", "cats", "dogs",
    "public libraries", "time management", "budgeting", "climate change", "earthquakes", "music theory",
    "painting with watercolors", "the human heart", "friendship", "video games", "robots", "trains",
    "mountain hiking", "camping", "the solar system", "bicycles", "healthy breakfasts", "meditation",
    "writing a resume", "job interviews", "public speaking", "birds migrating", "snow", "deserts",
    "ancient Egypt", "the Olympic games", "pizza", "tea", "origami", "photography", "museums",
    "machine learning", "databases", "cloud computing", "smartphones", "keyboards", "a lighthouse",
    "a small bakery", "a lost umbrella", "a talking parrot", "a rainy Monday", "the first day of school",
]


def split_of(text: str, heldout_every: int = 12) -> str:
    """``"heldout"`` for about one prompt in ``heldout_every`` (stable across runs), else ``"train"``."""
    h = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)
    return "heldout" if h % heldout_every == 0 else "train"


def _chat(text: str, category: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "category": category}


def chat_prompts() -> list[dict]:
    return [_chat(t.format(t=topic), "chat") for t in CHAT_TEMPLATES for topic in TOPICS]


def gsm8k_prompts(datasets_dir: Path) -> list[dict]:
    path = datasets_dir / "gsm8k" / "gsm8k_dev.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().split("\n") if line.strip()]
    return [_chat(r["question"] + "\nSolve step by step.", "math") for r in rows]


def humaneval_prompts(datasets_dir: Path) -> list[dict]:
    path = datasets_dir / "humaneval" / "humaneval_dev.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().split("\n") if line.strip()]
    return [_chat("Complete this Python function:\n\n" + r["prompt"], "code") for r in rows]


def stdlib_prompts(limit: int = 400, seed: int = 0) -> list[dict]:
    """Ask for explanations or completions of standard-library functions (their source)."""
    import collections, csv, difflib, fractions, heapq, json as json_mod, shlex, statistics, string, textwrap  # noqa: E401

    funcs = []
    for mod in (collections, csv, difflib, fractions, heapq, json_mod, shlex, statistics, string, textwrap):
        for name, obj in inspect.getmembers(mod, inspect.isfunction):
            if obj.__module__ == mod.__name__ and not name.startswith("_"):
                try:
                    src = inspect.getsource(obj)
                except (OSError, TypeError):
                    continue
                if 200 < len(src) < 1500:
                    funcs.append(src)
    rng = random.Random(seed)
    rng.shuffle(funcs)
    out = []
    for i, src in enumerate(funcs[:limit]):
        head = src[: max(80, len(src) // 3)]
        if i % 2 == 0:
            out.append(_chat("Explain what this Python function does:\n\n" + src, "code"))
        else:
            out.append(_chat("Continue this Python code:\n\n" + head, "code"))
    return out


def require_datasets(datasets_dir: Path) -> Path:
    """``datasets_dir`` if it holds the GSM8K and HumanEval subsets (``gsm8k/gsm8k_dev.jsonl``,
    ``humaneval/humaneval_dev.jsonl``).

    Raises:
        FileNotFoundError: naming the missing file, so a benchmark never silently drops categories.
    """
    for rel in ("gsm8k/gsm8k_dev.jsonl", "humaneval/humaneval_dev.jsonl"):
        if not (Path(datasets_dir) / rel).is_file():
            raise FileNotFoundError(f"{Path(datasets_dir) / rel} not found: pass --datasets-dir DIR holding the "
                                    "GSM8K and HumanEval subsets (math and code prompts)")
    return Path(datasets_dir)


def build_prompts(datasets_dir: Path | None, split: str) -> list[dict]:
    """All prompts of one split (``train`` or ``heldout``), interleaved by category.

    Our own sources are split by :func:`split_of`. The GSM8K and HumanEval files in ``datasets_dir``
    are development sets: they are for measuring only, so all of their prompts are ``heldout`` and
    none is ever ``train``."""
    chosen = [p for p in chat_prompts() + stdlib_prompts() if split_of(p["messages"][0]["content"]) == split]
    if datasets_dir is not None and split == "heldout":
        chosen += gsm8k_prompts(datasets_dir) + humaneval_prompts(datasets_dir)
    random.Random(1).shuffle(chosen)
    return chosen


def first_per_category(prompts: list[dict], n: int) -> dict[str, list[dict]]:
    """The first ``n`` prompts of each category, categories in order of first appearance."""
    by_cat: dict[str, list[dict]] = {}
    for p in prompts:
        rows = by_cat.setdefault(p.get("category", "unknown"), [])
        if len(rows) < n:
            rows.append(p)
    return by_cat
