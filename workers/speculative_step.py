"""One generation-phase step for one sequence: plain, or ReDrafter draft-tree verification.

Both feed tokens that are not yet in the KV cache (the pending root token, plus the drafted tree
for a speculative step) and return the tokens to emit and the hidden state that chose the last of
them.
"""

from __future__ import annotations

import torch

from workers.executor import LocalExecutor
from workers.forward_batch import contiguous_batch
from workers.redrafter.acceptance import accept_greedy, accept_sampled
from workers.redrafter.tree import build_prefix_tree
from workers.sampling import SamplingParams, adjusted_probs, sample


def plain_step(
    model: LocalExecutor, L: int, root: int, params: SamplingParams, generator
) -> tuple[list[int], torch.Tensor]:
    """Feed ``root`` at position and slot ``L``; returns ``([next_token], hidden [H])``."""
    hidden = model.forward(contiguous_batch(torch.tensor([root], device=model.device), L))[0]
    logits = model.logits(hidden[None])
    if params.greedy:
        return [int(logits.argmax())], hidden
    return [int(sample(adjusted_probs(logits, params), generator)[0])], hidden


def speculative_step(
    model: LocalExecutor, L: int, beams: torch.Tensor, params: SamplingParams, generator
) -> tuple[list[int], torch.Tensor]:
    """Verify ``beams`` (``[num_beams, draft_len + 1] long``, column 0 = pending root token).

    ``L`` is the committed length (slots ``0..L-1`` hold the prefix). The prefix tree's nodes are
    written to scratch slots ``L + node``; positions are ``L + depth``;
    each node attends to the committed prefix and to its ancestors (tree attention). The accepted
    path is moved to ``L..`` and the rest discarded.

    Returns:
        (accepted draft tokens + bonus token, hidden ``[H]`` of the last accepted node).
    """
    dev = model.device
    tree = build_prefix_tree(beams)
    batch = contiguous_batch(tree.tokens.to(dev), L, tree.mask.to(dev), L + tree.depths.to(dev))
    hidden = model.forward(batch)
    logits = model.logits(hidden)
    if params.greedy:
        path, bonus = accept_greedy(tree, logits.argmax(-1).tolist())
    else:
        path, bonus = accept_sampled(tree, adjusted_probs(logits, params), generator)
    if path != list(range(len(path))):
        model.copy_slots(torch.tensor(path, device=dev) + L, torch.arange(L, L + len(path), device=dev))
    tokens = tree.tokens[path[1:]].tolist() + [bonus]
    return tokens, hidden[path[-1]]
