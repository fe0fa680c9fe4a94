"""What one base-model forward computes: packed tokens, their KV-cache slots, attention groups.

In-flight batching packs the new tokens of every scheduled request into one flat sequence of
``num_tokens`` rows, so every linear layer runs once for the whole iteration (context chunks,
generation tokens and draft trees alike). Attention runs per *group*: a group is ``batch`` requests
with ``seq_len`` new tokens each (padded), laid out contiguously in the packed order, with the KV
slots each request reads (gathered through its block table) and a boolean mask (causal for a
context chunk, tree attention for a ReDrafter draft tree, ReDrafter arXiv 2403.09919 Sec. 3.3).

Everything here is plain tensors, so the leader of a tensor-parallel replica can broadcast it to
its ranks unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionGroup:
    """``batch`` requests with ``seq_len`` new tokens each, at packed rows
    ``[start, start + batch * seq_len)`` (request-major).

    kv_slots: ``[batch, kv_len] long`` cache slots each request reads, in position order; slots of
        the new tokens are included (they are written before attention reads).
    mask: ``[batch, 1, seq_len, kv_len] bool``; True where new token t may attend to kv entry j.
        Every row needs at least one True (padding tokens attend to themselves).
    kv_run_start: when ``batch == 1`` and the kv slots are ``s, s + 1, ..., s + kv_len - 1``, that
        ``s``: the cache then reads a view instead of gathering.
    decode: the rows are decoding steps or draft trees (not a prompt chunk): attention must compute
        every such row the same way whatever the group's size, so that greedy speculative output
        stays bit-identical to plain output (:func:`workers.kernels.decode_attention.plan`).
    """

    start: int
    batch: int
    seq_len: int
    kv_slots: torch.Tensor
    mask: torch.Tensor
    kv_run_start: int | None = None
    decode: bool = False

    @property
    def num_tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def kv_len(self) -> int:
        return self.kv_slots.shape[1]


@dataclass
class ForwardBatch:
    """One iteration's base-model input.

    input_ids, positions, slot_mapping: ``[num_tokens] long``; positions are RoPE positions
        (prefix length + tree depth for draft-tree tokens); slot_mapping is the cache slot each
        token's keys/values are written to (padding tokens write to the cache's trash slot).
    groups: attention groups covering ``[0, num_tokens)`` in order.
    prompt_rows: ``[P] long`` rows that are prompt tokens, when not every row of the leading
        context chunks is one (a chunk that recomputes a preempted request's generated tokens);
        None: the rows before the first ``decode`` group (see :attr:`prefill_rows`).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]
    prompt_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def prefill_rows(self) -> int | torch.Tensor:
        """The rows that are prompt tokens, which linears may compute on a prefill path
        (``engine.prefill_dtype``): :attr:`prompt_rows` where given, else a count of leading rows
        (the context chunks, which the runner packs first, before the first ``decode`` group)."""
        if self.prompt_rows is not None:
            return self.prompt_rows
        for g in self.groups:
            if g.decode:
                return g.start
        return self.num_tokens

    def to(self, device: torch.device | str) -> "ForwardBatch":
        groups = [
            AttentionGroup(g.start, g.batch, g.seq_len, g.kv_slots.to(device), g.mask.to(device), g.kv_run_start,
                           g.decode)
            for g in self.groups
        ]
        return ForwardBatch(
            self.input_ids.to(device), self.positions.to(device), self.slot_mapping.to(device), groups,
            None if self.prompt_rows is None else self.prompt_rows.to(device),
        )


def contiguous_batch(input_ids: torch.Tensor, start: int, mask: torch.Tensor | None = None,
                     positions: torch.Tensor | None = None, base_slot: int = 0) -> ForwardBatch:
    """A single-request batch over one contiguous run of slots (tests, drafter training, the
    single-request path): position p lives in slot ``base_slot + p``; the ``start`` tokens before
    the new ones are already cached.

    input_ids: ``[T] long`` new tokens, written at slots ``base_slot + start ..``.
    mask: ``[T, T] bool`` among the new tokens (default causal); the prefix is always visible.
    positions: ``[T] long`` (default ``start + arange(T)``).
    """
    T = input_ids.numel()
    dev = input_ids.device
    if positions is None:
        positions = torch.arange(start, start + T, device=dev)
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    full = torch.ones(T, start + T, dtype=torch.bool, device=dev)
    full[:, start:] = mask
    kv_slots = torch.arange(base_slot, base_slot + start + T, device=dev)[None]
    group = AttentionGroup(0, 1, T, kv_slots, full[None, None], kv_run_start=base_slot)
    new = torch.arange(base_slot + start, base_slot + start + T, device=dev)
    return ForwardBatch(input_ids, positions, new, [group])

