"""``isa``: every kernel build this CPU runs (``avx512``, ``avx2``), forced through ``RDSERVE_CPU_ISA``
while the test builds its modules (a module keeps the variant it was built with)."""

import pytest

from workers.kernels import build


@pytest.fixture(params=["avx512", "avx2"])
def isa(request, monkeypatch):
    if not build.available():
        pytest.skip("CPU kernels unavailable here (no C compiler or no AVX2, or RDSERVE_CPU_KERNELS=0)")
    if request.param not in build.supported_isas():
        pytest.skip(f"this CPU cannot run the {request.param} build")
    monkeypatch.setenv("RDSERVE_CPU_ISA", request.param)
    return request.param
