"""Logits processors: logit bias, ``min_tokens``, repetition/frequency/presence penalties and a grammar's
token mask, applied to each row with the token history of the position that row predicts.

Under speculation a row belongs to a draft-tree node, and its history is the committed output plus the
drafted tokens on the node's own path (never its siblings' or the committed history alone), so the
processed distribution at every node is exactly the one plain decoding computes once that path is
committed: greedy speculative output equals greedy plain output, and exact speculative sampling
(:func:`workers.redrafter.acceptance.accept_sampled`) keeps the processed distribution.

Order and semantics follow vLLM's sampler (``logit_bias``, ``min_tokens``, then penalties; the grammar
mask last, as its structured-output bitmask is applied after the processors), all before temperature,
top-k and top-p (:func:`workers.sampling.adjusted_probs`).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from workers.sampling_params import SamplingParams


def node_counts(output_ids: list[int], path_tokens: torch.Tensor | None, path_mask: torch.Tensor | None,
                vocab_size: int) -> torch.Tensor:
    """Token counts of each row's output history.

    output_ids: the committed output tokens. path_tokens: ``[m - 1] long``, the drafted tokens of tree
    nodes 1..m-1 (node 0, the root, is the last committed token and already in ``output_ids``);
    path_mask: ``[m, m - 1] bool``, ``path_mask[i, j]`` iff node ``j + 1`` is node i or one of its
    ancestors (``PrefixTree.mask[:, 1:]``). Both None for one row (plain decoding).

    Returns ``[m, vocab_size] float32``: row i counts each token in the output plus node i's path.
    """
    base = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab_size)[:vocab_size].float() \
        if output_ids else torch.zeros(vocab_size)
    if path_tokens is None or path_tokens.numel() == 0:
        rows = 1 if path_mask is None else path_mask.shape[0]
        return base.expand(rows, vocab_size).clone()
    counts = base.repeat(path_mask.shape[0], 1)
    row, col = path_mask.nonzero(as_tuple=True)
    counts.index_put_((row, path_tokens[col]), torch.ones(len(row)), accumulate=True)
    return counts


def process_logits(logits: torch.Tensor, params: SamplingParams, output_ids: list[int],
                   prompt_seen: torch.Tensor | None, depths: torch.Tensor | None = None,
                   path_tokens: torch.Tensor | None = None, path_mask: torch.Tensor | None = None,
                   stop_ids: Collection[int] = (), allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The logits a request samples from (or takes the argmax of), one row per predicted position.

    logits: ``[m, V] float32``, the base model's raw logits; row i predicts the token after tree node i
    (one row, ``m = 1``, for plain decoding or a prompt's last position). depths: ``[m] long``, each
    node's depth (None: all 0): row i predicts output token number ``len(output_ids) + depths[i]``.
    path_tokens, path_mask: see :func:`node_counts`. prompt_seen: ``[V] bool``, tokens in the prompt
    (for ``repetition_penalty``; None when it is off). stop_ids: EOS and ``stop_token_ids``, forbidden
    (-inf) before ``params.min_tokens`` output tokens, except in a row where the grammar allows
    nothing else (its output is complete: the grammar's end wins, so a row always keeps a token).
    allowed: ``[m, V] bool``, the grammar's tokens per row (:mod:`workers.structured`), or None.

    Returns a new ``[m, V] float32`` tensor, or ``logits`` itself when nothing applies. A row may end
    with every entry -inf only if ``allowed`` forbids everything, which a grammar never does.
    """
    if not params.has_processors and allowed is None:
        return logits
    out = logits.float().clone()
    m, vocab = out.shape
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        keep = ids < vocab
        out[:, ids[keep]] += torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)[keep]
    if params.min_tokens and stop_ids:
        index = len(output_ids) + (depths if depths is not None else torch.zeros(m, dtype=torch.long))
        early = index < params.min_tokens
        ids = torch.tensor(sorted(stop_ids), dtype=torch.long)
        ids = ids[ids < vocab]
        if allowed is not None and early.any():  # a complete grammar's end wins over min_tokens: a row
            others = allowed.clone()              # that may only stop keeps its stop tokens
            others[:, ids] = False
            early &= others.any(-1).to(early.device)
        if early.any():
            out[early.nonzero(as_tuple=True)[0].unsqueeze(1), ids.unsqueeze(0)] = float("-inf")
    if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
        counts = node_counts(output_ids, path_tokens, path_mask, vocab)
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            if prompt_seen is not None:
                seen |= prompt_seen
            penalised = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
            out = torch.where(seen, penalised, out)
        if params.frequency_penalty:
            out -= params.frequency_penalty * counts
        if params.presence_penalty:
            out -= params.presence_penalty * (counts > 0).float()
    if allowed is not None:
        out.masked_fill_(~allowed, float("-inf"))
    return out


def prompt_presence(prompt_ids: list[int], vocab_size: int) -> torch.Tensor:
    """``[vocab_size] bool``: the tokens that occur in the prompt."""
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    ids = torch.tensor(prompt_ids, dtype=torch.long)
    seen[ids[ids < vocab_size]] = True
    return seen
