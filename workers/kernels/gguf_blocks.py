"""GGUF quantized blocks, regrouped (not requantized) into the panels our kernels read.

Source formats (ggml's ``ggml-common.h``, the GGUF file format's ``block_q4_1`` and ``block_q8_0``;
gguf-py's ``gguf.quants`` reads them the same way). A quantized ``[N, K]`` tensor is stored row by
row, each row as ``K / 32`` blocks of 32 consecutive k:

* ``Q4_1`` (20 bytes, 5 bits per weight): float16 ``d``, float16 ``m``, 16 bytes ``qs``;
  weight ``i`` = ``d * q_i + m``, ``q_i = qs[i] & 15`` for ``i < 16``, ``qs[i - 16] >> 4`` above.
* ``Q8_0`` (34 bytes, 8.5 bits per weight): float16 ``d``, int8 ``qs[32]``; weight ``i`` = ``d * qs[i]``.

Panel layouts (``q4_1_gemm.c``, ``q8_0_gemm.c``): ``[ceil(N / 32), K / 32, PANEL_BLOCK_BYTES]`` uint8,
for each panel of 32 rows and k-block the 32 rows' scales side by side, then the quantized values
k-row by k-row (Q4_1: row ``i`` in the low 4 bits and row ``16 + i`` in the high 4 bits of byte
``i``). Rows past ``N`` are zero. The same bytes per weight as the file, every value as shipped.
Panels are allocated on huge pages (:mod:`workers.kernels.hugepages`). :func:`reorder_for_vnni`
regroups panels in place for the int8-activation kernels (``q4_1_vnni.c``, ``q8_0_vnni.c``): each
k-block's quantized bytes by groups of 4 consecutive k, the same bytes per weight.
"""

from __future__ import annotations

import numpy as np
import torch

from workers.kernels import hugepages

QK = 32  # weights per GGUF block (along K)
PANEL = 32  # output rows per panel
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
PANEL_BLOCK_BYTES = {"Q4_1": 64 + 64 + QK * PANEL // 2, "Q8_0": 64 + QK * PANEL}
FORMATS = tuple(BLOCK_BYTES)


def _check(fmt: str, raw: np.ndarray) -> tuple[int, int]:
    if fmt not in BLOCK_BYTES:
        raise ValueError(f"unsupported block format {fmt!r}; supported: {', '.join(FORMATS)}")
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % BLOCK_BYTES[fmt]:
        raise ValueError(f"{fmt} data must be uint8 [N, K / 32 * {BLOCK_BYTES[fmt]}], got {raw.dtype} {raw.shape}")
    return raw.shape[0], raw.shape[1] // BLOCK_BYTES[fmt]


def _by_panel(a: np.ndarray, panels: int, nb: int) -> np.ndarray:
    """``[N_pad, nb, *rest]`` per-row block fields -> ``[panels, nb, 32 (row j), *rest]``."""
    return np.moveaxis(a.reshape(panels, PANEL, nb, *a.shape[2:]), 1, 2)


def panels_from_blocks(fmt: str, raw: np.ndarray) -> torch.Tensor:
    """GGUF blocks of an ``[N, K]`` tensor (``raw``: uint8 ``[N, K / 32 * BLOCK_BYTES[fmt]]``, rows in
    output order) -> panels uint8 ``[ceil(N / 32), K / 32, PANEL_BLOCK_BYTES[fmt]]``.

    Raises:
        ValueError: an unsupported format or a wrongly shaped array.
    """
    n, nb = _check(fmt, raw)
    panels = -(-n // PANEL)
    blocks = np.zeros((panels * PANEL, nb, BLOCK_BYTES[fmt]), np.uint8)
    blocks[:n] = raw.reshape(n, nb, BLOCK_BYTES[fmt])
    if fmt == "Q4_1":
        scales = _by_panel(blocks[..., 0:4].reshape(-1, nb, 2, 2), panels, nb)  # [P, nb, j, (d|m), 2 bytes]
        scales = np.moveaxis(scales, 3, 2).reshape(panels, nb, 128)  # d[32] then m[32]
        qs = blocks[..., 4:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [N_pad, nb, kk]
        q = np.moveaxis(_by_panel(q, panels, nb), 2, 3)  # [P, nb, kk, j]
        packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(panels, nb, QK * PANEL // 2)
    else:
        scales = _by_panel(blocks[..., 0:2], panels, nb).reshape(panels, nb, 64)
        packed = np.moveaxis(_by_panel(blocks[..., 2:], panels, nb), 2, 3).reshape(panels, nb, QK * PANEL)
    out = hugepages.empty((panels, nb, PANEL_BLOCK_BYTES[fmt]), torch.uint8)
    out.numpy()[..., : scales.shape[-1]] = scales
    out.numpy()[..., scales.shape[-1] :] = packed
    return out


def reorder_for_vnni(fmt: str, panels: torch.Tensor) -> None:
    """Reorder panels (uint8 ``[P, K / 32, PANEL_BLOCK_BYTES[fmt]]`` of :func:`panels_from_blocks`) in
    place into the int8-activation kernels' layout, groups of 4 consecutive k ``kk = 4 g + t``:

    * Q4_1 (``q4_1_vnni.c``): the byte of k-row ``kk``, column pair ``i`` (row ``i`` low nibble,
      row ``16 + i`` high) moves from ``q[kk][i]`` to ``q[g][i][t]``;
    * Q8_0 (``q8_0_vnni.c``): ``q[kk][16 h + i]`` moves to ``q[g][h][i][t]`` and becomes unsigned,
      ``qs + 128``.

    So one 64-byte vector holds in its int32 lane ``i`` 4 consecutive k of its rows. Scales stay
    where they are; every value is kept.
    """
    p = panels.numpy()
    count, nb = p.shape[:2]
    if fmt == "Q4_1":
        q = p[..., 128:]
        q[...] = q.reshape(count, nb, QK // 4, 4, PANEL // 2).swapaxes(3, 4).reshape(q.shape)
    else:
        q = p[..., 64:]
        q[...] = q.reshape(count, nb, QK // 4, 4, 2, PANEL // 2).transpose(0, 1, 2, 4, 5, 3).reshape(q.shape) ^ 128


def dequantize_panels(fmt: str, panels: torch.Tensor, n: int, vnni: bool = False) -> torch.Tensor:
    """Panels (see :func:`panels_from_blocks`; with ``vnni``, after :func:`reorder_for_vnni`) ->
    float32 ``[n, K]``, the weights the kernels compute with (float32 ``d * q + m`` / ``d * q``, as
    gguf-py's ``dequantize``)."""
    p = panels.numpy()
    count, nb = p.shape[:2]
    d = p[..., 0:64].copy().view(np.float16).astype(np.float32)[:, :, None, :]  # [P, nb, 1, j]
    if fmt == "Q4_1":
        m = p[..., 64:128].copy().view(np.float16).astype(np.float32)[:, :, None, :]
        qb = p[..., 128:].reshape(count, nb, QK, PANEL // 2)
        if vnni:
            qb = qb.reshape(count, nb, QK // 4, PANEL // 2, 4).swapaxes(3, 4).reshape(qb.shape)
        q = np.concatenate([qb & 15, qb >> 4], axis=-1).astype(np.float32)  # [P, nb, kk, j]
        w = d * q + m
    elif fmt == "Q8_0":
        q = p[..., 64:].reshape(count, nb, QK, PANEL)
        if vnni:
            q = (q.reshape(count, nb, QK // 4, 2, PANEL // 2, 4).transpose(0, 1, 2, 5, 3, 4) ^ 128).reshape(q.shape)
        w = d * q.copy().view(np.int8).astype(np.float32)
    else:
        raise ValueError(f"unsupported block format {fmt!r}; supported: {', '.join(FORMATS)}")
    w = np.moveaxis(w, 3, 1).reshape(count * PANEL, nb * QK)  # [P, j, nb, kk] -> rows 32 p + j
    return torch.from_numpy(np.ascontiguousarray(w[:n]))
