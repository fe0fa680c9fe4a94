"""Kernel names key speculation schedules by the compute path they were measured on; an engine
takes its own path's schedule."""

from __future__ import annotations

import pytest

from workers.engine import Engine
from workers.kernel_name import check_kernel_name, kernel_name
from workers.spec_schedule import largest_speculating_batch, validate_schedule


@pytest.mark.parametrize("args, name", [
    (("cpu", "gguf", "avx512", True), "gguf-avx512-int8"),
    (("cpu", "gguf", "avx2", False), "gguf-avx2"),
    (("cpu", "float32", None, False), "float32-torch"),
    (("cpu", "bfloat16", None, False), "bfloat16-torch"),
    (("cuda:1", "float32", None, False), "cuda"),
])
def test_kernel_names(args, name):
    assert kernel_name(*args) == name
    assert check_kernel_name(name) == name


@pytest.mark.parametrize("args, message", [
    (("cpu", "float32", "avx2", True), "int8 activations run on GGUF blocks only"),
    (("cpu", "gguf", "neon", False), "unknown kernel ISA 'neon'"),
    (("cpu", "q4", None, False), "unknown weights 'q4'"),
])
def test_kernel_name_errors(args, message):
    with pytest.raises(ValueError, match=message):
        kernel_name(*args)


@pytest.mark.parametrize("name", ["avx2", "gguf-avx2-int4", "GGUF-AVX2", "float32-avx512-"])
def test_check_kernel_name_rejects(name):
    with pytest.raises(ValueError, match="is not a kernel name"):
        check_kernel_name(name)


@pytest.mark.parametrize("variant", ["tied_gqa2", "tied_gqa2@gguf"])
def test_engine_takes_the_schedule_of_its_own_kernel(tiny_model_dirs, tmp_path, variant):
    from tiny_model import make_tiny_drafter_dir

    model = tiny_model_dirs[variant]
    drafter = str(make_tiny_drafter_dir(model, tmp_path / "drafter"))
    kw = dict(num_kv_blocks=64, max_batch_size=8)
    fallback = [{"max_batch_size": 2, "num_beams": 1, "draft_len_per_beam": 1}]
    mine = [{"max_batch_size": 3, "num_beams": 2, "draft_len_per_beam": 2}, {"max_batch_size": 5, "num_beams": 1,
                                                                              "draft_len_per_beam": 2}]
    kernel = Engine(model, drafter, spec_schedule=fallback, **kw).kernel
    assert check_kernel_name(kernel) == kernel and kernel.startswith("gguf-" if "gguf" in variant else "float32-")
    auto = Engine(model, drafter, decode_activations="auto", **kw).kernel  # int8 on GGUF blocks, any ISA
    assert auto.endswith("-int8") == ("gguf" in variant) and auto.removesuffix("-int8") == kernel
    other = "gguf-avx512-int8" if kernel != "gguf-avx512-int8" else "gguf-avx2"
    ours = Engine(model, drafter, spec_schedule=fallback, spec_schedule_by_kernel={kernel: mine, other: "off"}, **kw)
    assert ours.spec_schedule == validate_schedule(mine) and largest_speculating_batch(ours.spec_schedule) == 5
    elsewhere = Engine(model, drafter, spec_schedule=fallback, spec_schedule_by_kernel={other: mine}, **kw)
    assert elsewhere.spec_schedule == validate_schedule(fallback)
