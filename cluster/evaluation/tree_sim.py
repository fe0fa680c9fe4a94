"""Offline replay of draft-tree policies on greedy responses: exact acceptance, priced step costs.

Greedy speculative decoding emits exactly the plain greedy response (lossless), so the response
alone decides what any draft tree accepts: after the response's token ``i`` the tree's longest
beam prefix that equals tokens ``i + 1 ..`` is accepted, plus the bonus token. Replaying a policy
over recorded responses therefore gives its exact tokens per step (ReDrafter, arXiv 2403.09919
Sec. 4: accepted draft tokens + 1) and its tree sizes without running the base model once per
policy. A step is then priced from a measured table of step time against tree rows
(``benchmarks/tree_costs.py``), which turns tokens per step into the decode-phase speedup over
plain decoding that the policy would reach on that machine.

What is exact: tokens per step and rows per step for the recorded responses (drafter proposals
come from the recorded hidden states; near-ties aside they are the engine's). What is modelled:
the step time, a function of the tree's rows and drafted positions only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Beam = list[int]
"""Drafted tokens of one beam, after the root (the last emitted token)."""


def accepted_length(beams: Sequence[Beam], truth: Sequence[int]) -> int:
    """Longest prefix of any beam equal to ``truth`` (the tokens that greedy decoding emits next)."""
    best = 0
    for beam in beams:
        m = 0
        while m < len(beam) and m < len(truth) and beam[m] == truth[m]:
            m += 1
        best = max(best, m)
    return best


def tree_rows(beams: Sequence[Beam]) -> int:
    """Rows the base model verifies for ``beams``: the root plus one per distinct beam prefix (the
    prefix tree of :func:`workers.redrafter.tree.build_prefix_tree`)."""
    return 1 + len({tuple(b[:n]) for b in beams for n in range(1, len(b) + 1)})


@dataclass(frozen=True)
class RowCosts:
    """Measured decode-step time at batch 1 (milliseconds).

    plain_ms: a plain step. tree_ms: ``tree_ms[r - 2]`` is a speculative step verifying ``r`` rows
    (``r >= 2``; one drafted position); wider trees extrapolate the last two entries linearly.
    draft_position_ms: each drafted position after the first.

    Raises:
        ValueError: an empty ``tree_ms`` or a non-positive time.
    """

    plain_ms: float
    tree_ms: tuple[float, ...]
    draft_position_ms: float = 0.0

    def __post_init__(self):
        if not self.tree_ms or self.plain_ms <= 0 or min(self.tree_ms) <= 0 or self.draft_position_ms < 0:
            raise ValueError(f"step costs must be positive with at least one tree width, got {self}")

    def spec_ms(self, rows: int, positions: int) -> float:
        """Time of a speculative step of ``rows`` rows (>= 2) and ``positions`` drafted positions."""
        t = self.tree_ms
        i = rows - 2
        base = t[i] if i < len(t) else t[-1] + (t[-1] - (t[-2] if len(t) > 1 else self.plain_ms)) * (i - len(t) + 1)
        return base + self.draft_position_ms * max(0, positions - 1)


Policy = Callable[[int, Sequence[int], int], tuple[list[Beam], int]]
"""``policy(i, context, limit) -> (beams, drafted positions)`` for the step after response token
``i``; ``context`` is the prompt plus the response up to and including token ``i``; ``limit`` is the
most tokens a beam may draft (the engine's: ``max_tokens`` less the tokens emitted, less one for the
bonus; a policy cuts its beams to it, as ``ModelRunner._draft`` does). A policy with state
(a prompt-lookup beam whose length follows its acceptance) may also have ``observe(accepted)``,
called after each step with the accepted draft tokens."""


@dataclass
class Replay:
    """Totals of one policy over some responses."""

    steps: int = 0
    tokens: int = 0
    rows: int = 0
    spec_ms: float = 0.0
    plain_ms: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def rows_per_step(self) -> float:
        return self.rows / self.steps if self.steps else 0.0

    @property
    def decode_speedup(self) -> float:
        """Plain decode time of the same tokens over the policy's (prefill excluded)."""
        return self.plain_ms / self.spec_ms if self.spec_ms else 0.0


def replay(prompt: Sequence[int], response: Sequence[int], policy: Policy, costs: RowCosts,
           max_tokens: int | None = None, into: Replay | None = None) -> Replay:
    """Speculative decoding of ``response`` (greedy, batch 1) under ``policy``, added to ``into``.

    ``response`` is what plain greedy decoding emitted with ``max_tokens`` (None: ``len(response)``,
    a response cut by its length); one that ends earlier ends with its stop token. The first token
    comes from the prefill. Each later step starts after token ``i`` as ``Engine.step`` does: with
    ``max_tokens - (i + 1) - 1`` draft tokens allowed (none: a plain step), it accepts
    :func:`accepted_length` of the policy's beams and the bonus token, of which only those up to the
    response's end are emitted (the engine drops what follows a stop token).

    Raises:
        ValueError: ``max_tokens`` below the response's length.
    """
    n = len(response)
    max_tokens = n if max_tokens is None else max_tokens
    if max_tokens < n:
        raise ValueError(f"max_tokens {max_tokens} is below the response's {n} tokens")
    out = into if into is not None else Replay()
    context = list(prompt) + list(response[:1])
    i = 0
    while i < n - 1:
        limit = max_tokens - (i + 1) - 1
        beams, positions = policy(i, context, limit) if limit >= 1 else ([], 0)
        beams = [b[:limit] for b in beams if b and limit >= 1]
        accepted = accepted_length(beams, response[i + 1:]) if beams else 0
        emitted = min(accepted + 1, n - 1 - i)
        rows = tree_rows(beams)
        out.steps += 1
        out.tokens += emitted
        out.rows += rows
        out.spec_ms += costs.spec_ms(rows, positions) if beams else costs.plain_ms
        out.plain_ms += costs.plain_ms * emitted
        observe = getattr(policy, "observe", None)
        if observe is not None and limit >= 1:  # a plain step tells a policy nothing
            observe(list(response[i + 1 : i + 1 + accepted]))
        context.extend(response[i + 1 : i + 1 + emitted])
        i += emitted
    return out
