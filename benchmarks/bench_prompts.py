"""Prompts of the served-load benchmarks: where the shared datasets live, their chat rows, and the
options that size a closed-loop load."""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.evaluation.prompts import PromptRow, load_prompts

DATASETS = Path(__file__).resolve().parents[2] / "shared" / "datasets"
"""The shared datasets folder (holds ``broad/``, ``gsm8k/``, ``humaneval/``), beside the repository."""


def chat_prompts(path: str | Path, limit: int | None = None) -> list[PromptRow]:
    """The first ``limit`` rows of prompt JSONL ``path`` that are chat rows (have ``messages``);
    every chat row when ``limit`` is None."""
    return [r for r in load_prompts(path) if r.messages is not None][:limit]


def add_load_options(ap: argparse.ArgumentParser) -> None:
    """Add ``--num-prompts`` (int), ``--max-tokens`` (int, tokens), ``--concurrency`` (comma-separated
    ints) and ``--modes`` (comma-separated ``rdserve.mode`` values) to ``ap``, in that order; returns nothing."""
    ap.add_argument("--num-prompts", type=int, default=9, help="first N chat prompts of the file")
    ap.add_argument("--max-tokens", type=int, default=128, help="completion tokens per request (at most)")
    ap.add_argument("--concurrency", default="1,16", help="comma-separated closed-loop concurrency levels")
    ap.add_argument("--modes", default="plain,spec", help="comma-separated rdserve.mode values")
