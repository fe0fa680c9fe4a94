"""Weight buffers on transparent huge pages, for the kernels' weight streams.

Decoding streams every weight once per step; with 4 KiB pages that is a TLB miss every 4 KiB (135k
per float32 step of the default model). Linux's transparent huge pages are often ``madvise``-only
(``/sys/kernel/mm/transparent_hugepage/enabled``), so torch's allocations get 4 KiB pages while
llama.cpp's mmapped GGUF file may sit on the page cache's large folios. Here panels are placed in
anonymous mappings advised ``MADV_HUGEPAGE``: 2 MiB arenas of 64 MiB that tensors are carved from
(64-byte aligned), larger tensors in their own mapping. Measured (preliminary, shared machine,
whole float32 step at one row): 5-7% less time with 2 threads, 3-5% with one.

``RDSERVE_HUGEPAGES=0`` (or a platform without ``MADV_HUGEPAGE``) gives plain ``torch.empty``.
"""

from __future__ import annotations

import mmap
import os
import threading

import torch

ARENA_BYTES = 64 << 20
HUGE = 2 << 20
ALIGN = 64

_lock = threading.Lock()
_arena: list = [None, 0]  # [mmap, next free offset]


def enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("RDSERVE_HUGEPAGES", "1").lower() not in (
        "0", "off", "false", "no")


def _mapping(nbytes: int) -> mmap.mmap:
    m = mmap.mmap(-1, -(-nbytes // HUGE) * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP disabled ("never"): still a valid buffer
        pass
    return m


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, on huge-page-advised memory when :func:`enabled`.

    The memory lives as long as any tensor made from it.
    """
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not enabled() or nbytes < HUGE // 4:
        return torch.empty(shape, dtype=dtype)
    with _lock:
        if nbytes > ARENA_BYTES // 4:
            buf, offset = _mapping(nbytes), 0
        else:
            if _arena[0] is None or _arena[1] + nbytes > ARENA_BYTES:
                _arena[0], _arena[1] = _mapping(ARENA_BYTES), 0
            buf, offset = _arena[0], _arena[1]
            _arena[1] = -(-(offset + nbytes) // ALIGN) * ALIGN
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(shape)
