"""The clock of the kernel microbenchmarks: wall time, or the calling thread's CPU time."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable


def add_clock_option(ap: argparse.ArgumentParser) -> None:
    """Add ``--clock {wall,cpu}`` (default wall) to ``ap``; returns nothing. The script must also have
    ``--threads``."""
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this thread's CPU time (with --threads 1; excludes time preempted on a shared machine)")


def step_clock(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Callable[[], float]:
    """The clock ``args.clock`` names, a function returning seconds: ``time.thread_time`` for cpu,
    ``time.perf_counter`` for wall. Exits through ``ap.error`` for cpu with ``--threads`` other than 1
    (the CPU clock sees the calling thread only)."""
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu measures the calling thread only: use --threads 1")
    return time.thread_time if args.clock == "cpu" else time.perf_counter
