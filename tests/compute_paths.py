"""Which machine-specific compute paths a test run exercised, printed once per run.

A test of a machine-specific path (a kernel build, an int8 kernel, a prompt-row dtype, a GPU) runs
wherever the machine has the path and skips elsewhere naming what is missing, so a green run on one
CPU says nothing about another. ``make test`` therefore prints, in its header, the CPU model, the
instruction sets the kernels care about and the paths this CPU can run, and at the end how many
tests ran and skipped on each path (with the skip reasons), so every CI log says what it covered.

Paths are the values of the fixtures and parameters in :data:`PATH_AXES` (``isa``: the C kernels'
build, ``RDSERVE_CPU_ISA``; ``kernel``: the int8-activation kernel; ``prefill_dtype``: the prompt
rows' dtype), plus every test skipped for a missing instruction set or GPU.
"""

from __future__ import annotations

import platform
import re
from collections import Counter, defaultdict

PATH_AXES = ("isa", "kernel", "prefill_dtype")
"""Fixture / parameter names whose value is a compute path."""

FLAGS_OF_INTEREST = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                     "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
"""The ``/proc/cpuinfo`` flags some kernel path needs (workers/kernels/build.py, quant_linear.py, prefill_bf16.py)."""

MACHINE_SKIP = re.compile(r"needs (a GPU|a CPU|AVX|AMX)|this CPU (lacks|cannot)|CPU kernels unavailable", re.I)
"""Skip reasons that mean "this machine lacks the path" (as opposed to an optional tool missing)."""

_runs: dict[tuple[str, str], Counter] = defaultdict(Counter)
_skips: dict[tuple[str, str], Counter] = defaultdict(Counter)
_machine_skips: Counter = Counter()


def describe_machine() -> list[str]:
    """Header lines: the CPU, its relevant instruction sets, and the kernel paths it can run."""
    from workers.kernels import build
    from workers.kernels.prefill_bf16 import amx_bf16_available
    from workers.kernels.quant_linear import INT8_CPU_FLAGS, amx_unavailable

    have = [f for f in FLAGS_OF_INTEREST if not build.missing_cpu_flags({f})]
    isas = build.supported_isas()
    try:
        amx = [] if not isas or amx_unavailable() else ["amx"]
    except Exception:  # noqa: BLE001 - a header must never fail the run
        amx = []
    int8 = amx + (["vnni"] if not build.missing_cpu_flags(INT8_CPU_FLAGS) else []) + (["avx2"] if isas else [])
    try:
        import torch

        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - a header must never fail the run
        gpus = 0
    return [
        f"cpu: {build.cpu_model()} ({platform.machine()}), instruction sets: {' '.join(have) or 'none of interest'}",
        f"compute paths this machine runs: kernel builds (RDSERVE_CPU_ISA) {', '.join(isas) or 'none'}; "
        f"int8 kernels {', '.join(int8) or 'none'}; prompt rows float32, bfloat16 "
        f"({'AMX tiles' if amx_bf16_available() else 'oneDNN without AMX'}); GPUs {gpus}",
    ]


def record(item, report) -> None:
    """Count ``report`` (one phase of ``item``) under each compute path the test was parametrized by."""
    if report.when == "call" or (report.when == "setup" and report.skipped):
        params = getattr(getattr(item, "callspec", None), "params", {})
        paths = [(axis, str(params[axis])) for axis in PATH_AXES if axis in params]
        reason = str(report.longrepr[2]).removeprefix("Skipped: ") if report.skipped and isinstance(report.longrepr, tuple) else ""
        for path in paths:
            if report.skipped:
                _skips[path][reason] += 1
            else:
                _runs[path][report.outcome] += 1
        if report.skipped and MACHINE_SKIP.search(reason):
            _machine_skips[reason] += 1


def summary_lines() -> list[str]:
    """The end-of-run table: per path, tests run (passed/failed) and skipped with their reasons."""
    lines = []
    for path in sorted(set(_runs) | set(_skips)):
        ran = _runs.get(path, Counter())
        skipped = _skips.get(path, Counter())
        text = f"  {path[0]}={path[1]}: ran {sum(ran.values())}"
        if ran.get("failed"):
            text += f" ({ran['failed']} failed)"
        if skipped:
            text += f", skipped {sum(skipped.values())} (" + "; ".join(f"{n}x {r}" for r, n in skipped.most_common()) + ")"
        lines.append(text)
    if _machine_skips:
        lines.append("  skipped for what this machine lacks: " + "; ".join(f"{n}x {r}" for r, n in _machine_skips.most_common()))
    return lines


def require_both_builds() -> None:
    """Skip, naming what this CPU lacks, unless it runs both kernel builds (AVX-512 and AVX2)."""
    import pytest

    from workers.kernels import build

    if not build.available():
        pytest.skip("CPU kernels unavailable here (no C compiler or no AVX2, or RDSERVE_CPU_KERNELS=0)")
    missing = build.missing_cpu_flags(build.ISA_CPU_FLAGS["avx512"] | build.ISA_CPU_FLAGS["avx2"])
    if missing:
        pytest.skip(f"needs a CPU that runs both builds, AVX-512 and AVX2 (this CPU lacks {', '.join(missing)})")
