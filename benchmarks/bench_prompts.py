"""Prompts of the served-load benchmarks: where the shared datasets live, their chat rows, and the
options that size a closed-loop load."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cluster.evaluation.prompts import PromptRow, load_prompts

DATASETS = Path(__file__).resolve().parents[2] / "shared" / "datasets"
"""The shared datasets folder (holds ``broad/``, ``gsm8k/``, ``humaneval/``), beside the repository."""


def chat_prompts(path: str | Path, limit: int | None = None) -> list[PromptRow]:
    """The first ``limit`` rows of prompt JSONL ``path`` that are chat rows (have ``messages``);
    every chat row when ``limit`` is None."""
    return [r for r in load_prompts(path) if r.messages is not None][:limit]


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def chat_rows_or_exit(ap: argparse.ArgumentParser, path: str | Path) -> list[dict]:
    """The rows of prompt JSONL ``path`` that have a ``messages`` list, as dicts (their ``category``
    kept); ``ap.error`` (exit 2) naming the file, and the line, when it is not a file, a line is not
    JSON, or no row is a chat row."""
    path = Path(path)
    if not path.is_file():
        ap.error(f"--prompts {path}: not a file")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            ap.error(f"--prompts {path} line {n}: not JSON ({err})")
        if not isinstance(row, dict):
            ap.error(f"--prompts {path} line {n}: not a JSON object")
        if isinstance(row.get("messages"), list):
            rows.append(row)
    if not rows:
        ap.error(f"--prompts {path}: no row has a 'messages' list (chat rows only)")
    return rows


def add_load_options(ap: argparse.ArgumentParser) -> None:
    """Add ``--num-prompts`` (int), ``--max-tokens`` (int, tokens), ``--concurrency`` (comma-separated
    ints) and ``--modes`` (comma-separated ``rdserve.mode`` values) to ``ap``, in that order; returns nothing."""
    ap.add_argument("--num-prompts", type=int, default=9, help="first N chat prompts of the file")
    ap.add_argument("--max-tokens", type=int, default=128, help="completion tokens per request (at most)")
    ap.add_argument("--concurrency", default="1,16", help="comma-separated closed-loop concurrency levels")
    ap.add_argument("--modes", default="plain,spec", help="comma-separated rdserve.mode values")
