"""Shared test setup: make helpers in tests/ (e.g. ``tiny_tokenizer``) importable from any test."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars from the training code in test logs

import pytest
import torch

from compute_paths import describe_machine, record, summary_lines

# Tiny models are far faster on one thread than on two contended ones.
torch.set_num_threads(1)

# Tiny model variants: tied embeddings with 2 query heads per KV head; the same with logits x3
# (peaked sampling distributions, so sampled drafts are often accepted); untied embeddings with one
# KV head (multi-query attention), 3 layers and sharper logits (more varied greedy text).
TINY_VARIANTS = {
    "tied_gqa2": dict(seed=0, tie=True, kv_heads=2),
    "tied_sharp": dict(seed=0, tie=True, kv_heads=2, scale=3.0),
    "untied_mqa": dict(seed=1, tie=False, kv_heads=1, layers=3, scale=4.0),
}
# The same models shipped as GGUF ("<variant>@gguf", tiny_gguf.weights_variant).


def _make_tiny(root, name):
    from tiny_gguf import GGUF_SUFFIX, make_tiny_gguf
    from tiny_model import make_tiny_model_dir

    base = name.removesuffix(GGUF_SUFFIX)
    path = make_tiny_model_dir(root / name.replace("@", "-"), **TINY_VARIANTS[base])
    if name.endswith(GGUF_SUFFIX):
        make_tiny_gguf(path)
    return path


class _BuiltOnDemand(dict):
    """``dict`` whose missing entries are built by ``build(key)`` on first access."""

    def __init__(self, build):
        super().__init__()
        self._build = build

    def __missing__(self, key):
        with torch.inference_mode(False), torch.enable_grad():  # training may be first asked for there
            self[key] = value = self._build(key)
        return value


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """``{variant: model dir}`` for the entries of ``TINY_VARIANTS`` (and ``<variant>@gguf``), each
    built once per session."""
    root = tmp_path_factory.mktemp("tiny_models")
    return _BuiltOnDemand(lambda name: _make_tiny(root, name))


@pytest.fixture(scope="session")
def trained_drafter_dirs(tiny_model_dirs, tmp_path_factory):
    """``{variant: drafter dir}``: a ``shared`` drafter self-distilled on each tiny model (~10 s each)."""
    from tiny_model import make_trained_tiny_drafter_dir

    root = tmp_path_factory.mktemp("tiny_drafters")
    return _BuiltOnDemand(lambda name: make_trained_tiny_drafter_dir(tiny_model_dirs[name], root / name.replace("@", "-")))


@pytest.fixture(params=["avx512", "avx2"])
def isa(request, monkeypatch):
    """Every kernel build this CPU runs (``avx512``, ``avx2``), forced through ``RDSERVE_CPU_ISA``
    while the test builds its modules (a module keeps the variant it was built with); a build the CPU
    cannot run skips, naming the instruction sets it lacks."""
    from workers.kernels import build

    if not build.available():
        pytest.skip("CPU kernels unavailable here (no C compiler or no AVX2, or RDSERVE_CPU_KERNELS=0)")
    if request.param not in build.supported_isas():
        missing = build.missing_cpu_flags(build.ISA_CPU_FLAGS[request.param])
        pytest.skip(f"needs {request.param.upper()} (this CPU lacks {', '.join(missing)})")
    monkeypatch.setenv("RDSERVE_CPU_ISA", request.param)
    return request.param


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    record(item, outcome.get_result())


def pytest_terminal_summary(terminalreporter):
    """Once per run: the CPU, its instruction sets and the compute paths the run exercised and skipped."""
    terminalreporter.write_sep("-", "machine and compute paths")
    for line in describe_machine() + summary_lines():
        terminalreporter.write_line(line)
