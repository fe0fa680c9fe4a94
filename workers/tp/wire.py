"""Commands the leader broadcasts to its ranks, as picklable plain data.

A command is ``(op, args)`` with ``op`` one of :data:`OPS` and ``args`` a tuple that may hold
tensors and :class:`~workers.forward_batch.ForwardBatch` objects. Tensors travel as
``(dtype name, shape, numpy uint8 bytes)`` (pickle protocol 5 copies numpy buffers without
per-element work, and works for bfloat16, which numpy lacks) and arrive on the rank's device.
"""

from __future__ import annotations

import numpy as np
import torch

from workers.forward_batch import AttentionGroup, ForwardBatch

OPS = ("init", "forward", "logits", "copy_slots", "shutdown")


class _Tensor(tuple):
    """``(dtype name, shape, uint8 array)`` on the wire."""


class _Batch(tuple):
    """``(input_ids, positions, slot_mapping, groups)`` on the wire."""


def _pack_tensor(t: torch.Tensor) -> _Tensor:
    flat = t.detach().reshape(-1).contiguous().cpu()
    return _Tensor((str(t.dtype).removeprefix("torch."), tuple(t.shape), flat.view(torch.uint8).numpy()))


def _unpack_tensor(w: _Tensor, device: torch.device) -> torch.Tensor:
    dtype, shape, data = w
    return torch.from_numpy(np.ascontiguousarray(data)).view(getattr(torch, dtype)).reshape(shape).to(device)


def pack(obj: object) -> object:
    """Replace tensors and forward batches in ``obj`` (nested tuples/lists/dicts) by wire forms."""
    if isinstance(obj, torch.Tensor):
        return _pack_tensor(obj)
    if isinstance(obj, ForwardBatch):
        groups = [(g.start, g.batch, g.seq_len, pack(g.kv_slots), pack(g.mask), g.kv_run_start, g.decode)
                  for g in obj.groups]
        return _Batch((pack(obj.input_ids), pack(obj.positions), pack(obj.slot_mapping), groups, pack(obj.prompt_rows)))
    if isinstance(obj, (tuple, list)):
        return type(obj)(pack(x) for x in obj)
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    return obj


def unpack(obj: object, device: torch.device) -> object:
    """Inverse of :func:`pack`; tensors land on ``device``."""
    if isinstance(obj, _Tensor):
        return _unpack_tensor(obj, device)
    if isinstance(obj, _Batch):
        ids, pos, slots, groups, prompt_rows = obj
        groups = [
            AttentionGroup(s, b, t, unpack(kv, device), unpack(m, device), run, decode)
            for s, b, t, kv, m, run, decode in groups
        ]
        return ForwardBatch(unpack(ids, device), unpack(pos, device), unpack(slots, device), groups,
                            unpack(prompt_rows, device))
    if isinstance(obj, (tuple, list)):
        return type(obj)(unpack(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: unpack(v, device) for k, v in obj.items()}
    return obj
