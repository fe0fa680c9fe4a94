"""The forward batch's wire form (workers/tp/wire.py): every field, including the prompt rows of a
recompute chunk, reaches the other ranks unchanged."""

from __future__ import annotations

import pickle
from dataclasses import replace

import torch

from workers.forward_batch import contiguous_batch
from workers.tp.wire import pack, unpack


def test_forward_batch_round_trip_keeps_every_field():
    batch = contiguous_batch(torch.tensor([5, 9, 14, 3, 22]), 2, base_slot=8)
    batch = replace(batch, groups=[replace(batch.groups[0], decode=True)], prompt_rows=torch.tensor([0, 1, 3]))
    for original in (batch, replace(batch, prompt_rows=None)):
        got = unpack(pickle.loads(pickle.dumps(pack({"batch": original}))), torch.device("cpu"))["batch"]
        for name in ("input_ids", "positions", "slot_mapping"):
            assert torch.equal(getattr(got, name), getattr(original, name))
        assert (got.prompt_rows is None) == (original.prompt_rows is None)
        if original.prompt_rows is not None:
            assert torch.equal(got.prompt_rows, original.prompt_rows)
        (g,), (o,) = got.groups, original.groups
        assert (g.start, g.batch, g.seq_len, g.kv_run_start, g.decode) == (o.start, o.batch, o.seq_len, o.kv_run_start, o.decode)
        assert torch.equal(g.kv_slots, o.kv_slots) and torch.equal(g.mask, o.mask)
