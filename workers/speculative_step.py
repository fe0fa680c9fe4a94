"""One generation-phase step for one sequence: plain, or ReDrafter draft-tree verification.

Both feed tokens that are not yet in the KV cache (the pending root token, plus the drafted tree
for a speculative step) and return the tokens to emit and the hidden state that chose the last of
them.
"""

from __future__ import annotations

import torch

from workers.kv_cache import AttentionMetadata, KVCache
from workers.models.llama import LlamaForCausalLM
from workers.redrafter.acceptance import accept_greedy, accept_sampled
from workers.redrafter.tree import build_prefix_tree
from workers.sampling import SamplingParams, adjusted_probs, sample


def plain_step(
    model: LlamaForCausalLM, cache: KVCache, root: int, params: SamplingParams, generator
) -> tuple[list[int], torch.Tensor]:
    """Feed ``root`` at position ``cache.lengths[0]``; returns ``([next_token], hidden [H])``."""
    L = cache.lengths[0]
    dev = cache.device
    pos = torch.tensor([[L]], device=dev)
    meta = AttentionMetadata(
        rows=torch.zeros_like(pos), slots=pos, mask=torch.ones(1, 1, 1, L + 1, dtype=torch.bool, device=dev),
        kv_len=L + 1,
    )
    hidden = model(torch.tensor([[root]], device=dev), pos, cache, meta)[0, 0]
    cache.lengths[0] = L + 1
    logits = model.logits(hidden[None])
    if params.greedy:
        return [int(logits.argmax())], hidden
    return [int(sample(adjusted_probs(logits, params), generator)[0])], hidden


def speculative_step(
    model: LlamaForCausalLM, cache: KVCache, beams: torch.Tensor, params: SamplingParams, generator
) -> tuple[list[int], torch.Tensor]:
    """Verify ``beams`` (``[num_beams, draft_len + 1] long``, column 0 = pending root token).

    The prefix tree's nodes are written to scratch slots ``L + node``; positions are ``L + depth``;
    each node attends to the committed prefix and to its ancestors (tree attention). The accepted
    path is moved to ``L..`` and the rest discarded.

    Returns:
        (accepted draft tokens + bonus token, hidden ``[H]`` of the last accepted node).
    """
    L = cache.lengths[0]
    dev = cache.device
    tree = build_prefix_tree(beams)
    N = tree.tokens.numel()
    slots = torch.arange(L, L + N, device=dev)[None]
    mask = torch.ones(1, 1, N, L + N, dtype=torch.bool, device=dev)
    mask[0, 0, :, L:] = tree.mask.to(dev)
    meta = AttentionMetadata(rows=torch.zeros_like(slots), slots=slots, mask=mask, kv_len=L + N)
    hidden = model(tree.tokens.to(dev)[None], (L + tree.depths.to(dev))[None], cache, meta)[0]
    logits = model.logits(hidden)
    if params.greedy:
        path, bonus = accept_greedy(tree, logits.argmax(-1).tolist())
    else:
        path, bonus = accept_sampled(tree, adjusted_probs(logits, params), generator)
    cache.commit_path(0, L, path)
    tokens = tree.tokens[path[1:]].tolist() + [bonus]
    return tokens, hidden[path[-1]]
