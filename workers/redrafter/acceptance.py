"""Which draft tokens the base model accepts: greedy matching and exact speculative sampling.

Both walk the packed prefix tree (:mod:`workers.redrafter.tree`) from the root and return
``(path, bonus_token)``: ``path`` lists the accepted node indices starting with the root 0, and
``bonus_token`` is the base model's own next token after the last accepted node, so every step emits
``len(path)`` tokens (the ``len(path) - 1`` accepted draft tokens plus the bonus token).
"""

from __future__ import annotations

import torch

from workers.redrafter.tree import PrefixTree


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


def accept_sampled(
    tree: PrefixTree, target_probs: torch.Tensor, generator: torch.Generator
) -> tuple[list[int], int]:
    """Exact speculative sampling for a deterministic (beam-search) draft tree.

    target_probs: ``[num_nodes, V] float32``; row i is the base model's adjusted distribution
    (:func:`workers.sampling.adjusted_probs`) after node i and its ancestors. ``generator`` must be
    on the device of ``target_probs``.

    At a node with target distribution p, the children x_1, x_2, ... are tried in order. Child x_k
    is accepted with probability ``p_k(x_k)``, where ``p_1 = p`` and ``p_{k+1}`` is ``p_k`` with
    x_k zeroed and renormalised; an accepted child becomes the current node. When every child is
    rejected, or the node is a leaf, the bonus token is drawn from the last residual and the walk
    stops. Each emitted token is therefore distributed exactly as p given the accepted prefix:
    P(emit x_1) = p(x_1), P(emit x_2) = (1 - p(x_1)) * p(x_2) / (1 - p(x_1)) = p(x_2), and so on,
    and, with K children, a token y outside them is emitted with probability
    ``prod_k (1 - p_k(x_k)) * p_{K+1}(y) = p(y)``.

    Why not Apple's rule. The standard test (Leviathan et al. arXiv 2211.17192 Sec. 2.3) accepts x
    with ``min(1, p(x) / q(x))`` and assumes x was *sampled* from the drafter's distribution q.
    ReDrafter's beam search (and the distinct-first search) *selects* likely beams, so a drafted token is a deterministic
    function of the context; its proposal distribution is a point mass, not q. Plugging the
    drafter's softmax q into the test then biases the output: with p(x) = 0.3 and q(x) = 0.2 it
    always accepts x, emitting it with probability 1 instead of 0.3 (apple/ml-recurrent-drafter
    issue #6). With the true proposal, a point mass at x (q(x) = 1), the same test becomes
    ``min(1, p(x) / 1) = p(x)`` and the residual ``norm(max(0, p - q))`` becomes p without x,
    renormalised; trying the next sibling against that residual applies the test recursively,
    which is the rule above.
    """
    tokens = tree.tokens.tolist()
    path = [0]
    while True:
        children = tree.children[path[-1]]
        p = target_probs[path[-1]]
        child_tokens = [tokens[child] for child in children]
        accepted = _first_accepted(p, child_tokens, generator)
        if accepted is None:
            break
        path.append(children[accepted])
    residual = p
    if child_tokens:
        residual = p.clone()
        residual[child_tokens] = 0.0
        if float(residual.sum()) <= 0.0:  # rounding left no mass outside the rejected tokens
            return path, int(p.argmax())
    return path, int(torch.multinomial(residual, 1, generator=generator))


def _first_accepted(p: torch.Tensor, child_tokens: list[int], generator: torch.Generator) -> int | None:
    """Index of the first accepted child token, or None when all are rejected.

    p: ``[V] float32``. Child k is accepted when ``u < p(x_k) / (mass of p left after rejecting
    x_1..x_{k-1})``, ``u ~ U[0, 1)``; the residual is renormalised through this scalar, so no row
    is copied. A zero-probability child is never accepted.
    """
    if not child_tokens:
        return None
    index = torch.tensor(child_tokens, device=p.device)
    head = torch.cat([p.sum().reshape(1), p[index]]).tolist()  # one device sync per node
    mass, child_probs = head[0], head[1:]
    draws = torch.rand(len(child_tokens), generator=generator, device=p.device).tolist()
    for k, (prob, u) in enumerate(zip(child_probs, draws)):
        if prob > 0.0 and u * mass < prob:
            return k
        mass -= prob
    return None
