"""The packed float32 CPU kernel (workers/kernels): values, row independence, module swapping,
and how it falls back. Value tests run on each instruction-set build (``isa`` fixture)."""

from __future__ import annotations

import pytest
from compute_paths import require_both_builds
import torch
import torch.nn.functional as F

from workers.kernels import build
from workers.kernels.packed_linear import PackedLinear, pack_linears, pack_weight, unpack_weight

needs_kernel = pytest.mark.skipif(not build.available(), reason="CPU kernels unavailable here (no C compiler or no AVX2, or RDSERVE_CPU_KERNELS=0)")


@pytest.mark.parametrize("n,k,bias", [(64, 32, False), (100, 37, True), (960, 576, False), (96, 70, True),
                                      (7, 1536, True), (130, 1, False)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 13, 40])
def test_matches_torch_linear(n, k, bias, m, isa):
    g = torch.Generator().manual_seed(n * 1000 + k + m)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    x = torch.randn(m, k, generator=g)
    want = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    packed = PackedLinear.from_linear(lin)
    assert packed.isa == isa
    got = packed(x)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 1e-5 * max(1.0, k**0.5)


@pytest.mark.parametrize("n", [960, 3072 + 40])  # 30 panels: the one-row path takes 3 at a time
def test_each_row_is_independent_of_the_others(n, isa):
    """Bit-identical rows for any batch: what makes greedy speculative decoding reproduce plain
    decoding exactly (a 1-row plain step and a 9-row tree compute the same values)."""
    g = torch.Generator().manual_seed(1)
    lin = PackedLinear.from_linear(torch.nn.Linear(576, n, bias=True))
    x = torch.randn(17, 576, generator=g)
    together = lin(x)
    for i in range(17):
        assert torch.equal(lin(x[i : i + 1])[0], together[i])
    assert torch.equal(lin(x[3:12]), together[3:12])


@needs_kernel
def test_both_builds_compute_the_same_bits(monkeypatch):
    """The AVX2 and AVX-512 builds sum each element in the same order: identical results."""
    require_both_builds()
    lin = torch.nn.Linear(1536, 3 * 32 * 7 + 5, bias=True)
    x = torch.randn(23, 1536)
    outs = []
    for isa in ("avx512", "avx2"):
        monkeypatch.setenv("RDSERVE_CPU_ISA", isa)
        packed = PackedLinear.from_linear(lin)
        assert build.library(packed.isa).rd_isa().decode() == isa
        outs.append((packed(x), packed(x[:1])))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_isa_override_is_checked(monkeypatch):
    monkeypatch.setenv("RDSERVE_CPU_ISA", "sse9")
    with pytest.raises(build.KernelUnavailable, match="RDSERVE_CPU_ISA must be auto, avx512 or avx2"):
        build.load()
    monkeypatch.setattr(build, "_cpu_flags", lambda: "flags: fpu sse2 avx2 fma f16c")
    monkeypatch.setenv("RDSERVE_CPU_ISA", "avx512")
    with pytest.raises(build.KernelUnavailable, match="lacks.*avx512f"):
        build.active_isa()
    monkeypatch.setenv("RDSERVE_CPU_ISA", "auto")
    assert build.active_isa() == "avx2"
    monkeypatch.setattr(build, "_cpu_flags", lambda: "flags: fpu sse2 avx")
    with pytest.raises(build.KernelUnavailable, match="neither AVX-512 nor AVX2"):
        build.active_isa()


@needs_kernel
def test_leading_dims_and_non_contiguous_input():
    lin = torch.nn.Linear(48, 70)
    packed = PackedLinear.from_linear(lin)
    x = torch.randn(3, 4, 96)[..., ::2]
    assert torch.allclose(packed(x), lin(x), atol=1e-5)
    assert packed(torch.randn(0, 48)).shape == (0, 70)


def test_pack_unpack_round_trip():
    w = torch.randn(130, 37)
    panels = pack_weight(w)
    assert panels.shape == (5, 37, 32)
    assert torch.equal(unpack_weight(panels, 130), w)
    assert torch.equal(panels[4, :, 2:], torch.zeros(37, 30))  # padding rows are zero


@needs_kernel
def test_rejects_other_dtypes():
    with pytest.raises(ValueError, match="float32 CPU weight"):
        PackedLinear.from_linear(torch.nn.Linear(8, 8).bfloat16())
    with pytest.raises(ValueError, match="float32 CPU input"):
        PackedLinear.from_linear(torch.nn.Linear(8, 8))(torch.randn(2, 8, dtype=torch.float64))


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.sub = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16).bfloat16())
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight


class _Subclass(torch.nn.Linear):
    pass


@needs_kernel
def test_pack_linears_swaps_float32_linears_and_keeps_tied_weights():
    m = _Tied()
    m.other = _Subclass(16, 16)
    proj_w = m.proj.weight.detach().clone()
    assert pack_linears(m) == 3  # proj, sub.0, head; not the bfloat16 one, not the subclass
    assert isinstance(m.proj, PackedLinear) and isinstance(m.sub[0], PackedLinear) and isinstance(m.head, PackedLinear)
    assert type(m.sub[1]) is torch.nn.Linear and type(m.other) is _Subclass
    assert m.head.weight is m.embed.weight  # the tied weight is kept, not copied
    assert torch.equal(m.proj.weight, proj_w)  # freed dense weight: unpacked on access
    x = torch.randn(5, 16)
    assert torch.allclose(m.head(x), F.linear(x, m.embed.weight), atol=1e-5)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("RDSERVE_CPU_KERNELS", "0")
    with pytest.raises(build.KernelUnavailable, match="RDSERVE_CPU_KERNELS"):
        build.load()
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert pack_linears(m) == 0 and type(m[0]) is torch.nn.Linear


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("RDSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-rdserve")
    with pytest.raises(build.KernelUnavailable, match="no-such-compiler-rdserve"):
        build.build()


@needs_kernel
def test_build_is_cached_per_source(monkeypatch, tmp_path):
    monkeypatch.setenv("RDSERVE_CACHE", str(tmp_path))
    path = build.build()
    assert path.is_file() and path.parent == tmp_path / "kernels"
    mtime = path.stat().st_mtime_ns
    assert build.build() == path and path.stat().st_mtime_ns == mtime


@needs_kernel
def test_state_dict_is_unchanged_by_packing():
    m = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Linear(40, 8, bias=False))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    pack_linears(m)
    after = m.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


@needs_kernel
def test_state_dict_round_trip_and_copies():
    import copy
    import pickle

    src = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Linear(40, 8, bias=False))
    dst = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Linear(40, 8, bias=False))
    pack_linears(src)
    pack_linears(dst)
    dst.load_state_dict(src.state_dict())
    x = torch.randn(3, 16)
    assert torch.equal(dst(x), src(x))
    assert torch.equal(copy.deepcopy(src)(x), src(x))
    assert torch.equal(pickle.loads(pickle.dumps(src))(x), src(x))


@needs_kernel
def test_cast_after_packing_is_refused():
    m = torch.nn.Sequential(torch.nn.Linear(16, 40))
    pack_linears(m)
    m.to(torch.float64)
    with pytest.raises(RuntimeError, match="moved or cast"):
        m(torch.randn(2, 16))


@needs_kernel
def test_damaged_library_in_the_cache_is_rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv("RDSERVE_CACHE", str(tmp_path))
    path = build.build()
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 3])  # truncated: loading it would crash the process
    assert build.build() == path and path.read_bytes() == good
    path.write_bytes(b"")
    assert build.build() == path and path.read_bytes() == good


def test_compiler_that_writes_nothing_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("RDSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "true")
    with pytest.raises(build.KernelUnavailable, match="empty library"):
        build.build()
