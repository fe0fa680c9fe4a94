"""Beams to a packed prefix tree for tree-attention verification.

ReDrafter's beam search proposes ``num_beams`` candidate continuations that often share prefixes.
Verifying each shared prefix once packs the beams into a prefix tree: one node per distinct
(ancestor path, token), attended to with a mask that lets each node see only itself and its
ancestors (ReDrafter arXiv 2403.09919 Sec. 3.2, "dynamic tree attention"; Apple's
ml-recurrent-drafter docs call this beam_to_prefix_tree; TensorRT-LLM packs ReDrafter beams the
same way). Position ids of the packed tokens are ``prefix_len + depths``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefixTree:
    """Packed draft tree; a parent always precedes its children (nodes ordered by depth, then beam).

    tokens: ``[num_nodes] long``; node 0 is the root, the last accepted token shared by all beams.
    parents: ``[num_nodes] long``; parent node index, -1 for the root.
    depths: ``[num_nodes] long``; root depth 0.
    beam_nodes: ``[num_beams, max_beam_len] long``; node index of each beam position, -1 past the end
        of a shorter beam.
    mask: ``[num_nodes, num_nodes] bool``; ``mask[i, j]`` iff j is i or an ancestor of i.
    children: children of each node, in order of first appearance (beam order).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    beam_nodes: torch.Tensor
    mask: torch.Tensor
    children: list[list[int]]

    @property
    def num_nodes(self) -> int:
        return len(self.children)


def build_prefix_tree(beams: torch.Tensor | list[list[int]]) -> PrefixTree:
    """Pack ``beams: [num_beams, draft_len_per_beam + 1] long`` (column 0: the shared root token),
    or a list of beams of different lengths (ReDrafter beams plus a longer prompt-lookup beam,
    :mod:`workers.redrafter.prompt_lookup`).

    Beams sharing a prefix share its nodes; identical beams collapse into one path. Runs every
    decoding step on a few dozen tokens, so it is a plain Python loop over the beams' lists.
    The returned tensors are on the CPU.

    Raises:
        ValueError: no beams, or beams with different root tokens.
    """
    rows = beams.tolist() if isinstance(beams, torch.Tensor) else beams
    if not rows or not rows[0]:
        raise ValueError("need at least one beam with its root token")
    root = rows[0][0]
    if any(not row or row[0] != root for row in rows):
        raise ValueError("all beams must start with the same root token")
    width = max(len(row) for row in rows)
    tokens, parents, depths, children = [root], [-1], [0], [[]]
    ancestors = [[0]]  # ancestors[i]: node i and its ancestors
    beam_nodes = [[0] + [-1] * (width - 1) for _ in rows]
    node_of = {}  # (parent node, token) -> node
    for depth in range(1, width):
        for beam, row in enumerate(rows):
            if depth >= len(row):
                continue
            parent = beam_nodes[beam][depth - 1]
            key = (parent, row[depth])
            node = node_of.get(key)
            if node is None:
                node = len(tokens)
                node_of[key] = node
                tokens.append(row[depth])
                parents.append(parent)
                depths.append(depth)
                children[parent].append(node)
                children.append([])
                ancestors.append(ancestors[parent] + [node])
            beam_nodes[beam][depth] = node
    num_nodes = len(tokens)
    query = [i for i, path in enumerate(ancestors) for _ in path]
    key_nodes = [j for path in ancestors for j in path]
    mask = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
    mask[query, key_nodes] = True
    return PrefixTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        depths=torch.tensor(depths, dtype=torch.long),
        beam_nodes=torch.tensor(beam_nodes, dtype=torch.long),
        mask=mask,
        children=children,
    )
