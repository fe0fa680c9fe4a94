"""Per-request draft trees cut by the drafter's confidence.

Every request of an iteration drafts the same shape (``num_beams x draft_len_per_beam``), but a
draft token is worth verifying only when it is likely to be accepted: a verified row costs the same
whether or not it is accepted. ReDrafter's drafter gives each drafted token a probability (the
softmax of its head, arXiv 2403.09919 Sec. 3.1); the probability that the base model accepts a
token at depth ``k`` of a beam is estimated by its *path probability*, the product of the drafter's
probabilities of the beam's tokens up to ``k``. Keeping a node is worth it when its path probability
``p`` exceeds the tokens it would displace: at an iteration that makes ``R`` tokens/s, a row that
costs ``dt`` seconds pays when ``p > R * dt`` (:func:`min_path_prob`). Confident requests keep their
whole tree, unsure ones a shorter one or none (their step is then plain).

A path probability never grows along a beam (each factor is at most 1), and cutting each beam at
its first node below the threshold keeps a prefix of it, so the kept beams form a prefix-closed tree. Verification is unchanged, so greedy output is too: only how
many rows are verified changes.

Pure functions; no torch.
"""

from __future__ import annotations

import math


def prune_beams(beams: list[list[int]], probs: list[list[float]], min_prob: float) -> list[list[int]]:
    """Cut each beam before its first drafted token whose path probability is below ``min_prob``.

    Args:
        beams: ``[width][1 + d]`` token ids, column 0 the root (shared by all beams).
        probs: ``[width][d']`` (``d' >= d``) the drafter's probability of each drafted token given its
            beam's earlier tokens; a NaN counts as below every threshold.
        min_prob: the threshold on the path probability (product of ``probs`` along the beam); 0 keeps
            every beam whole up to its first NaN.

    Returns:
        the kept beams, each ``[root, t1, ..]`` with at least one drafted token, in their order;
        ``[]`` when no drafted token is kept.

    Raises:
        ValueError: ``min_prob`` outside [0, 1], or ``probs`` with fewer rows than ``beams``.
    """
    if not 0.0 <= min_prob <= 1.0:
        raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
    if len(probs) < len(beams):
        raise ValueError(f"{len(beams)} beams but probabilities for {len(probs)}")
    kept = []
    for beam, p in zip(beams, probs):
        path, n = 1.0, 1
        for k in range(1, len(beam)):
            path *= p[k - 1]
            if not path >= min_prob:  # NaN: not confident
                break
            n = k + 1
        if n > 1:
            kept.append(beam[:n])
    return kept


def min_path_prob(row_s: float, rate: float, scale: float = 1.0) -> float:
    """The path probability a draft node needs to be verified: ``scale * rate * row_s``, at most 1.

    Adding a node to an iteration that makes ``rate`` tokens/s (all its requests together) and
    costing ``row_s`` seconds adds ``p`` expected tokens; the iteration's tokens/s grows iff
    ``p / row_s > rate``. ``scale`` corrects for a drafter whose probabilities over- (``> 1``) or
    under-state (``< 1``) how often the base model accepts.

    Raises:
        ValueError: a negative or non-finite ``row_s``, ``rate`` or ``scale``.
    """
    for name, v in (("row_s", row_s), ("rate", rate), ("scale", scale)):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {v}")
    return min(scale * rate * row_s, 1.0)
