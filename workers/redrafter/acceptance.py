"""Which draft tokens the base model accepts: greedy matching and exact speculative sampling.

Both walk the packed prefix tree (:mod:`workers.redrafter.tree`) from the root and return
``(path, bonus_token)``: ``path`` lists the accepted node indices starting with the root 0, and
``bonus_token`` is the base model's own next token after the last accepted node, so every step emits
``len(path)`` tokens (the ``len(path) - 1`` accepted draft tokens plus the bonus token).
"""

from __future__ import annotations

import torch

from workers.redrafter.tree import PrefixTree
from workers.sampling import sample_keyed


def accept_greedy(tree: PrefixTree, target_argmax: list[int] | torch.Tensor) -> tuple[list[int], int]:
    """Follow the base model's argmax through the tree (ReDrafter arXiv 2403.09919 Sec. 3.2).

    target_argmax: ``[num_nodes] long``; entry i is the base model's argmax after node i and its
    ancestors. Siblings hold distinct tokens, so at most one child matches at each node. The result
    is the longest prefix of any beam that matches the base model's argmax, plus the bonus token.
    """
    argmax = target_argmax.tolist() if isinstance(target_argmax, torch.Tensor) else target_argmax
    tokens = tree.tokens.tolist()
    path = [0]
    node = 0
    while True:
        match = next((child for child in tree.children[node] if tokens[child] == argmax[node]), None)
        if match is None:
            return path, argmax[node]
        path.append(match)
        node = match


def accept_sampled(tree: PrefixTree, target_probs: torch.Tensor, draws: list[float]) -> tuple[list[int], int]:
    """Exact speculative sampling for a deterministic (drafter-searched) draft tree, with keyed draws.

    target_probs: ``[num_nodes, V] float32``; row i is the base model's adjusted distribution
    (:func:`workers.sampling.adjusted_probs`) after node i and its ancestors. draws: one uniform in
    ``[0, 1)`` per depth, at least ``max depth + 1`` of them; ``draws[d]`` picks the token after a
    node at depth d (:func:`workers.sampling.keyed_uniform` of the request's seed and that token's
    sequence position).

    At the current node (from the root) the base model's token is sampled from its row by inverse
    CDF with the draw of its depth (:func:`workers.sampling.sample_keyed`); the child holding that
    token, if any, is accepted and becomes the current node; otherwise the sampled token is the bonus
    token and the walk stops. Every emitted token is therefore exactly the token plain decoding
    samples at that position with the same draw: output is distributed as the base model's, and a
    seeded request emits the same tokens whether or not a step drafted and whatever the tree.
    Child x is accepted with probability p(x), as with the recursive rejection rule for point-mass
    proposals (try x_1 with p(x_1), then x_2 against the residual, ...), so acceptance is the same.

    Why not Apple's rule. The standard test (Leviathan et al. arXiv 2211.17192 Sec. 2.3) accepts x
    with ``min(1, p(x) / q(x))`` and assumes x was *sampled* from the drafter's distribution q.
    ReDrafter's beam search (and the distinct-first search) *selects* likely beams, so a drafted token is a deterministic
    function of the context; its proposal distribution is a point mass, not q. Plugging the
    drafter's softmax q into the test then biases the output: with p(x) = 0.3 and q(x) = 0.2 it
    always accepts x, emitting it with probability 1 instead of 0.3 (apple/ml-recurrent-drafter
    issue #6). With the true proposal, a point mass at x (q(x) = 1), the test becomes
    ``min(1, p(x) / 1) = p(x)``, which sampling the target token and matching it gives.

    Raises:
        IndexError: fewer draws than the accepted path needs.
    """
    tokens = tree.tokens.tolist()
    path = [0]
    while True:
        node = path[-1]
        sampled = sample_keyed(target_probs[node : node + 1], [draws[len(path) - 1]])[0]
        match = next((child for child in tree.children[node] if tokens[child] == sampled), None)
        if match is None:
            return path, sampled
        path.append(match)
