"""Kernel names key speculation schedules by the compute path they were measured on; an engine
takes its own path's schedule."""

from __future__ import annotations

import pytest

from workers.engine_builder import load_engine
from workers.compute_path import check_compute_path_name, compute_path_name
from workers.speculation.schedule import validate_schedule


@pytest.mark.parametrize("args, name", [
    (("cpu", "gguf", "avx512", True), "gguf-avx512-int8"),
    (("cpu", "gguf", "amx", True), "gguf-amx-int8"),
    (("cpu", "gguf", "avx2", False), "gguf-avx2"),
    (("cpu", "float32", None, False), "float32-torch"),
    (("cpu", "bfloat16", None, False), "bfloat16-torch"),
    (("cuda:1", "float32", None, False), "cuda"),
])
def test_kernel_names(args, name):
    assert compute_path_name(*args) == name
    assert check_compute_path_name(name) == name


@pytest.mark.parametrize("args, message", [
    (("cpu", "float32", "avx2", True), "int8 activations run on GGUF blocks only"),
    (("cpu", "gguf", "neon", False), "unknown kernel ISA 'neon'"),
    (("cpu", "gguf", "amx", False), "the amx path is the int8-activation kernel's"),
    (("cpu", "float32", "amx", True), "int8 activations run on GGUF blocks only"),
    (("cpu", "q4", None, False), "unknown weights 'q4'"),
])
def test_kernel_name_errors(args, message):
    with pytest.raises(ValueError, match=message):
        compute_path_name(*args)


@pytest.mark.parametrize("name", ["avx2", "gguf-avx2-int4", "GGUF-AVX2", "float32-avx512-", "gguf-amx", "float32-amx-int8"])
def test_check_compute_path_name_rejects(name):
    with pytest.raises(ValueError, match="is not a compute path"):
        check_compute_path_name(name)


@pytest.mark.parametrize("variant", ["tied_gqa2", "tied_gqa2@gguf"])
def test_engine_takes_the_table_of_its_own_compute_path(tiny_model_dirs, tmp_path, variant):
    from tiny_model import make_tiny_drafter_dir

    model = tiny_model_dirs[variant]
    drafter = str(make_tiny_drafter_dir(model, tmp_path / "drafter"))
    kw = dict(num_kv_blocks=64, max_batch_size=8)
    fallback = [{"max_batch_size": 2, "num_beams": 1, "draft_len_per_beam": 1}]
    mine = [{"max_batch_size": 3, "num_beams": 2, "draft_len_per_beam": 2}, {"max_batch_size": 5, "num_beams": 1,
                                                                              "draft_len_per_beam": 2}]
    table = dict(policy="table", table=fallback)
    path = load_engine(model, drafter, **table, **kw).compute_path
    assert check_compute_path_name(path) == path and path.startswith("gguf-" if "gguf" in variant else "float32-")
    auto = load_engine(model, drafter, decode_activations="auto", **kw).compute_path  # int8 on GGUF blocks, any ISA
    assert auto.endswith("-int8") == ("gguf" in variant)
    # the AVX-512 build's int8 kernel is AMX's where the CPU has it: that path has its own name
    assert auto.removesuffix("-int8") == (path if auto != "gguf-amx-int8" else "gguf-amx") and \
        (auto != "gguf-amx-int8" or path == "gguf-avx512")
    other = "gguf-avx512-int8" if path != "gguf-avx512-int8" else "gguf-avx2"
    ours = load_engine(model, drafter, **table, by_compute_path={path: {"table": mine}, other: {"table": "off"}}, **kw)
    assert ours.spec_policy.table == validate_schedule(mine) and ours.spec_selection.spec_max_load == 5
    assert ours.spec_selection.source == f"speculation.by_compute_path.{path}.table"
    elsewhere = load_engine(model, drafter, **table, by_compute_path={other: {"table": mine}}, **kw)
    assert elsewhere.spec_policy.table == validate_schedule(fallback) and elsewhere.spec_selection.spec_max_load is None
