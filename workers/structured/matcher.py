"""``RequestGrammar``: one request's grammar state, and the tokens it allows at every node of a
draft tree.

Exactness under speculative decoding: the base model's logits at tree node ``i`` are masked with
the tokens the grammar allows after the path root -> ``i``, so acceptance (greedy or speculative
sampling, ReDrafter arXiv 2403.09919 Sec. 3.3) sees, at every node, the same constrained
distribution plain decoding would see after committing that path. The tree is walked depth-first
on the request's own matcher with accept / rollback (xgrammar's rollback is unbounded), so the
committed state is the same before and after.
"""

from __future__ import annotations

import torch
import xgrammar

from workers.structured.compiler import CompiledGrammar
from workers.structured.errors import GrammarError
from workers.structured.mask import unpack_bitmask


class RequestGrammar:
    """The grammar state of one request: the tokens committed so far, and masks for the next ones.

    Stop tokens (``compiled.stop_token_ids``: the engine's EOS ids) are allowed exactly where the
    grammar is complete, and forbidden before; once the output can only end, the allowed set is
    the stop tokens alone (``done``). Special tokens and padded ids (>= the tokenizer's
    vocabulary) are never allowed. After a stop token is committed (``is_terminated``) nothing is
    constrained any more: masks are all-True and ``advance`` ignores further tokens, as the stop
    rules end the output at the stop token.

    Not thread-safe: use one request's grammar from one thread (the engine thread).
    """

    def __init__(self, compiled: CompiledGrammar):
        self.compiled = compiled
        self.vocab_size = compiled.vocab_size
        self._matcher = xgrammar.GrammarMatcher(compiled.grammar)
        self._never = compiled.special_token_ids
        self._bitmask = xgrammar.allocate_token_bitmask(1, self.vocab_size)  # [rows, ceil(V/32)] int32, grown

    @property
    def is_terminated(self) -> bool:
        """A stop token has been committed: the output has ended."""
        return self._matcher.is_terminated()

    @property
    def done(self) -> bool:
        """The output is complete: committed text matches the grammar and only a stop token may
        follow (or one already has). The engine may end the request here without a forward."""
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():
            return False
        allowed = self.allowed()
        allowed[list(self.compiled.stop_token_ids)] = False
        return not bool(allowed.any())

    def allowed(self) -> torch.Tensor:
        """Tokens allowed next in the committed state: ``[vocab_size] bool`` (all-True once
        terminated). Plain decoding: the tree of one node."""
        return self._fill([0], [-1])[0]

    def tree_allowed(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Tokens allowed after each node's path, for a draft tree.

        tokens: ``[num_nodes]`` token ids; node 0 is the root, the last committed token (already
        advanced; its id is not read). parents: ``[num_nodes]``, ``parents[0] == -1`` and
        ``0 <= parents[i] < i`` (``workers.redrafter.tree.PrefixTree`` order).

        Returns ``[num_nodes, vocab_size] bool``: row ``i`` is what the grammar allows right after
        root -> ... -> ``i``. A node whose token the grammar rejects after its parent's path can
        never be accepted (its parent's row forbids it), and neither can its descendants: their
        rows are all-True, so their masked logits stay finite (no NaN from an all -inf softmax).
        Rows after a stop token are all-True too (the output ends there). The committed state is
        unchanged on return, also when this raises.

        Raises:
            ValueError: ``parents`` is not a tree in that order, or the lengths differ.
        """
        if len(tokens) != len(parents) or not tokens:
            raise ValueError(f"tokens ({len(tokens)}) and parents ({len(parents)}) must have the same non-zero length")
        if parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i > 0):
            raise ValueError(f"parents must be -1 for the root and precede their children: {parents}")
        return self._fill(tokens, parents)

    def advance(self, tokens: list[int]) -> int:
        """Commit ``tokens`` (the accepted tokens of a step); returns how many were committed:
        all of them, or up to and including a stop token (the rest is ignored).

        Raises:
            GrammarError: the grammar rejects a token (a bug upstream: every token sampled from
                masked logits is allowed); the state is then as before the call.
        """
        m = self._matcher
        for n, token in enumerate(tokens):
            if m.is_terminated():
                return n
            if not self._accept(token):
                if n:
                    m.rollback(n)
                raise GrammarError(f"token {token} (position {n} of {len(tokens)} in this step) is not allowed "
                                   f"by the request's {self.compiled.spec.kind} grammar")
        return len(tokens)

    def _accept(self, token: int) -> bool:
        # Special/padded ids are rejected before the library, which logs a warning for each.
        if token in self._never or not 0 <= token < self.vocab_size:
            return False
        return self._matcher.accept_token(token)

    def _fill(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Depth-first walk: accept a node's token, fill its row, visit its children, roll back."""
        num_nodes = len(tokens)
        if self._bitmask.shape[0] < num_nodes:
            self._bitmask = xgrammar.allocate_token_bitmask(num_nodes, self.vocab_size)
        bitmask = self._bitmask[:num_nodes]
        bitmask.fill_(-1)  # all-True: rows of unreachable nodes and rows after a stop token
        children: list[list[int]] = [[] for _ in range(num_nodes)]
        for node in range(num_nodes - 1, 0, -1):
            children[parents[node]].append(node)  # reversed, so the stack pops them in order
        m = self._matcher
        depth = 0
        stack: list[int] = [0]  # node ids to visit; -1 = leave the last accepted node (roll back)
        try:
            while stack:
                node = stack.pop()
                if node < 0:
                    m.rollback(1)
                    depth -= 1
                    continue
                if node > 0:
                    if not self._accept(tokens[node]):
                        continue
                    depth += 1
                    stack.append(-1)
                if not m.is_terminated():
                    m.fill_next_token_bitmask(self._bitmask, node)
                    stack.extend(children[node])
        finally:
            if depth:
                m.rollback(depth)
        return unpack_bitmask(bitmask, self.vocab_size)
