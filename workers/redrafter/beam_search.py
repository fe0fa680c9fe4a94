"""Beam search over the draft head (ReDrafter arXiv 2403.09919 Sec. 3.2), and a variant whose beams
all start with different tokens (:func:`draft_distinct_first_batch`).

``draft_len_per_beam`` counts drafted tokens only, excluding the root token the base model already
chose (TensorRT-LLM's ``redrafter_draft_len_per_beam``); ``num_beams`` is
``redrafter_num_beams``.
"""

from __future__ import annotations

import torch

from workers.redrafter.drafter import ReDrafter


@torch.inference_mode()
def draft_beams_batch(
    drafter: ReDrafter,
    embed,
    context: torch.Tensor,
    roots: torch.Tensor,
    num_beams: int,
    draft_len_per_beam: int,
) -> torch.Tensor:
    """Propose ``num_beams`` continuations of each sequence's root token, all sequences at once.

    Args:
        drafter: the draft head.
        embed: the base model's input embedding (frozen; ``e`` in Sec. 3.1), a callable
            ``ids [...] long -> [..., H]``.
        context: ``[B, H]`` base hidden state at each sequence's last accepted token (the one that
            chose the root).
        roots: ``[B] long`` the tokens the base model chose; every beam of sequence b starts with
            ``roots[b]``.

    Returns:
        beams: ``[B, width, draft_len_per_beam + 1] long``; column 0 is the root. Beam scores (sum
        of draft log-probabilities) are accumulated in float32; beams are ordered by score, best
        first. ``width = num_beams`` unless the (draft) vocabulary is smaller.
    """
    ids = drafter.draft_vocab  # None, or [Vd]: drafter index -> token id
    beams, state, scores, vocab = _first_level(drafter, embed, context, roots, num_beams, draft_len_per_beam > 1)
    B, width = beams.shape[:2]
    for _ in range(draft_len_per_beam - 1):
        state = drafter.step_state(state, embed(beams[:, :, -1]))  # [B, width, H]
        logp = torch.log_softmax(drafter.logits(context[:, None].expand(B, width, -1), state), dim=-1)  # [B, width, V]
        total = (scores[:, :, None] + logp).reshape(B, -1)
        scores, flat = total.topk(min(num_beams, total.shape[1]), dim=-1)  # [B, width']
        width = flat.shape[1]
        parent, token = flat // vocab, flat % vocab
        token = token if ids is None else ids[token]
        beams = torch.cat([beams.gather(1, parent[:, :, None].expand(-1, -1, beams.shape[2])), token[:, :, None]], 2)
        state = state.gather(1, parent[:, :, None].expand(-1, -1, state.shape[2]))
    return beams


DRAFT_SEARCHES = ("beam", "distinct_first")


@torch.inference_mode()
def draft_distinct_first_batch(
    drafter: ReDrafter,
    embed,
    context: torch.Tensor,
    roots: torch.Tensor,
    num_beams: int,
    draft_len_per_beam: int,
    with_probs: bool = False,
):
    """Beams that start with the ``num_beams`` most likely first draft tokens, each continued greedily.

    Beam search (:func:`draft_beams_batch`) keeps the best sequences, which often share their first
    token, so a tree offers one candidate where the drafter is least sure. Here every beam starts
    differently (top-``num_beams`` at the first position, like the first level of a Medusa tree), and
    the rest of each beam is the drafter's argmax: more first tokens are accepted (the drafter's card
    and BENCHMARKS.md give the figures). Same arguments and result layout as :func:`draft_beams_batch`; beams ordered by
    their first token's score; with ``num_beams`` 1 the two are the same.

    With ``with_probs`` it returns ``(beams, probs)``: ``probs [B, width, draft_len_per_beam] float32``,
    the drafter's softmax probability of each drafted token given its beam's earlier tokens (the
    confidence :func:`workers.redrafter.pruning.prune_beams` ranks draft tokens by).
    """
    ids = drafter.draft_vocab
    beams, state, scores, _ = _first_level(drafter, embed, context, roots, num_beams, with_probs)
    B, width = beams.shape[:2]
    probs = [scores.float().exp()] if with_probs else None  # log-probabilities -> probabilities, [B, width]
    for _ in range(draft_len_per_beam - 1):
        state = drafter.step_state(state, embed(beams[:, :, -1]))  # [B, width, H]
        logits = drafter.logits(context[:, None].expand(B, width, -1), state)  # [B, width, V]
        nxt = logits.argmax(-1)  # [B, width]
        if with_probs:
            probs.append(torch.softmax(logits.float(), dim=-1).gather(-1, nxt[:, :, None])[:, :, 0])
        nxt = nxt if ids is None else ids[nxt]
        beams = torch.cat([beams, nxt[:, :, None]], 2)
    return (beams, torch.stack(probs, dim=2)) if with_probs else beams


def _first_level(drafter: ReDrafter, embed, context: torch.Tensor, roots: torch.Tensor, num_beams: int,
                 log_probs: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The first draft position of both searches: the ``width = min(num_beams, vocab)`` best tokens.

    Returns ``beams [B, width, 2]`` (root, token id), ``state [B, width, H]`` (the RNN state that
    scored them), ``scores [B, width]`` (log-probabilities with ``log_probs``, else logits) and the
    drafter's vocabulary size (``V`` or ``Vd``).
    """
    B = roots.shape[0]
    state = drafter.first_state(embed(roots))  # [B, H]
    scores = drafter.logits(context, state)  # [B, V or Vd]
    if log_probs:  # only to rank later steps' beams; top-k of the logits is top-k of the log-probs
        scores = torch.log_softmax(scores, dim=-1)
    vocab = scores.shape[-1]
    scores, top = scores.topk(min(num_beams, vocab), dim=-1)  # [B, width]
    width = top.shape[1]
    top = top if drafter.draft_vocab is None else drafter.draft_vocab[top]
    beams = torch.stack([roots[:, None].expand(B, width), top], dim=2)
    return beams, state[:, None].expand(B, width, -1), scores, vocab
