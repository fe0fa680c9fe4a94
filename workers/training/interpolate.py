"""Weight-space interpolation of two draft heads (WiSE-FT, Wortsman et al. 2022, arXiv 2109.01903):
a fine-tuned head averaged with the head it started from keeps more of what the first knew.

The committed SmolLM2 drafter is such an average of a head trained on rdserve's own prompt sources and
its fine-tune on broad traffic (its card, ``workers/drafters/smollm2-135m-instruct/README.md``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from workers.redrafter.drafter import DRAFT_VOCAB_FILE

_SAME = ("vocab_size", "hidden_size", "num_draft_layers", "head_type")


def interpolate_drafters(first: Path, second: Path, weight: float, out: Path) -> dict:
    """Write ``out`` = ``(1 - weight) * first + weight * second``, tensor by tensor (float32 sums).

    The draft vocabulary is the sorted union of both heads' ``draft_vocab.json`` (a ``shared`` head
    scores any rows of the base LM head, so the union keeps every token either head drafts); none
    when either head drafts from the whole vocabulary.

    Returns the record written to ``out/interpolation.json``.

    Raises:
        FileNotFoundError: a directory without ``config.json`` or ``model.safetensors``.
        ValueError: ``weight`` outside [0, 1]; heads of different architecture or tensor names/shapes
            (names the field or tensor).
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight must be in [0, 1], got {weight}")
    cfgs, states = [], []
    for d in (first, second):
        if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
            raise FileNotFoundError(f"{d} is not a drafter directory (needs config.json and model.safetensors)")
        cfgs.append(json.loads((d / "config.json").read_text()))
        states.append(load_file(str(d / "model.safetensors")))
    for c in cfgs:
        c.setdefault("head_type", "full")  # Apple's configs have no head_type: their heads are full (load_drafter)
    for key in _SAME:
        if cfgs[0].get(key) != cfgs[1].get(key):
            raise ValueError(f"{key} differs: {first} has {cfgs[0].get(key)}, {second} has {cfgs[1].get(key)}")
    a, b = states
    if set(a) != set(b):
        raise ValueError(f"tensor names differ: {sorted(set(a) ^ set(b))}")
    mixed = {}
    for name in a:
        if a[name].shape != b[name].shape:
            raise ValueError(f"{name}: shape {tuple(a[name].shape)} in {first}, {tuple(b[name].shape)} in {second}")
        mixed[name] = ((1 - weight) * a[name].float() + weight * b[name].float()).to(a[name].dtype).contiguous()
    vocabs = [d / DRAFT_VOCAB_FILE for d in (first, second)]
    vocab = None
    if all(v.is_file() for v in vocabs):
        vocab = sorted(set(json.loads(vocabs[0].read_text())) | set(json.loads(vocabs[1].read_text())))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfgs[0], indent=2) + "\n")
    save_file(mixed, str(out / "model.safetensors"))
    (out / DRAFT_VOCAB_FILE).unlink(missing_ok=True)
    if vocab is not None:
        (out / DRAFT_VOCAB_FILE).write_text(json.dumps(vocab) + "\n")
    record = {"first": str(first.resolve()), "second": str(second.resolve()), "weight_of_second": weight,
              "draft_vocab_size": len(vocab) if vocab is not None else None}
    (out / "interpolation.json").write_text(json.dumps(record, indent=2) + "\n")
    return record
