"""Beam search over the draft head (ReDrafter arXiv 2403.09919 Sec. 3.2).

``draft_len_per_beam`` counts drafted tokens only, excluding the root token the base model already
chose (TensorRT-LLM's ``redrafter_draft_len_per_beam``); ``num_beams`` is
``redrafter_num_beams``.
"""

from __future__ import annotations

import torch

from workers.redrafter.drafter import ReDrafter


@torch.inference_mode()
def draft_beams(
    drafter: ReDrafter,
    embed: torch.nn.Embedding,
    context: torch.Tensor,
    root_token: int,
    num_beams: int,
    draft_len_per_beam: int,
) -> torch.Tensor:
    """Propose ``num_beams`` continuations of ``root_token``.

    Args:
        drafter: the draft head.
        embed: the base model's input embedding (frozen; ``e`` in Sec. 3.1).
        context: ``[H]`` base hidden state at the last accepted token (the one that chose the root).
        root_token: the token the base model chose; every beam starts with it.

    Returns:
        beams: ``[num_beams, draft_len_per_beam + 1] long``; column 0 is ``root_token``. Beam
        scores (sum of draft log-probabilities) are accumulated in float32; beams are ordered by
        score, best first. While fewer than ``num_beams`` sequences exist (a vocabulary smaller
        than the beam count), fewer beams are returned.
    """
    device = context.device
    ids = drafter.draft_vocab  # None, or [Vd]: drafter index -> token id
    tokens = torch.tensor([root_token], device=device)
    state = drafter.step_state(torch.zeros_like(context)[None], embed(tokens))  # [1, H]
    logp = torch.log_softmax(drafter.logits(context[None], state), dim=-1)  # [1, V or Vd]
    vocab = logp.shape[-1]
    scores, top = logp[0].topk(min(num_beams, vocab))  # [width]
    width = top.numel()
    top = top if ids is None else ids[top]
    beams = torch.cat([tokens.expand(width)[:, None], top[:, None]], dim=1)
    state = state.expand(width, -1)
    for _ in range(draft_len_per_beam - 1):
        state = drafter.step_state(state, embed(beams[:, -1]))
        logp = torch.log_softmax(drafter.logits(context[None].expand(width, -1), state), dim=-1)  # [width, V]
        total = (scores[:, None] + logp).reshape(-1)
        scores, flat = total.topk(min(num_beams, total.numel()))
        width = flat.numel()
        parent, token = flat // vocab, flat % vocab
        token = token if ids is None else ids[token]
        beams = torch.cat([beams[parent], token[:, None]], dim=1)
        state = state[parent]
    return beams
