import random

import pytest
import torch

from workers.redrafter.tree import PrefixTree, build_prefix_tree


def _check_invariants(tree: PrefixTree, beams: torch.Tensor) -> None:
    num_nodes = tree.num_nodes
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    assert tree.tokens.shape == tree.parents.shape == tree.depths.shape == (num_nodes,)
    assert tree.beam_nodes.shape == beams.shape
    assert parents[0] == -1 and tree.depths[0] == 0
    for node in range(1, num_nodes):
        assert 0 <= parents[node] < node
        assert tree.depths[node] == tree.depths[parents[node]] + 1
    assert torch.equal(tree.tokens[tree.beam_nodes], beams)
    for node, kids in enumerate(tree.children):
        assert kids == [c for c in range(num_nodes) if parents[c] == node]
        assert len({tokens[c] for c in kids}) == len(kids)
    expected = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
    for node in range(num_nodes):
        ancestor = node
        while ancestor != -1:
            expected[node, ancestor] = True
            ancestor = parents[ancestor]
    assert torch.equal(tree.mask, expected)
    paths = {tuple(row) for row in beams.tolist()}
    leaves = [n for n in range(num_nodes) if not tree.children[n]]
    assert len(leaves) == len(paths)


def test_shared_prefixes_are_deduplicated():
    beams = torch.tensor([[5, 1, 2], [5, 1, 3], [5, 1, 2]])
    tree = build_prefix_tree(beams)
    assert tree.num_nodes == 4
    assert tree.parents.tolist() == [-1, 0, 1, 1]
    assert tree.depths.tolist() == [0, 1, 2, 2]
    assert tree.children == [[1], [2, 3], [], []]
    assert tree.beam_nodes.tolist() == [[0, 1, 2], [0, 1, 3], [0, 1, 2]]
    _check_invariants(tree, beams)


def test_nodes_ordered_by_depth_then_beam():
    # Draft nodes: 1 (shared by two beams) and 4, then 2 and 3 under 1, 2 under 4: root + 5.
    beams = torch.tensor([[5, 1, 2], [5, 1, 3], [5, 4, 2]])
    tree = build_prefix_tree(beams)
    assert tree.tokens.tolist() == [5, 1, 4, 2, 3, 2]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert tree.children == [[1, 2], [3, 4], [5], [], [], []]
    assert tree.beam_nodes.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]
    _check_invariants(tree, beams)


def test_identical_beams_collapse():
    beams = torch.tensor([[9, 3, 7, 1]] * 4)
    tree = build_prefix_tree(beams)
    assert tree.tokens.tolist() == [9, 3, 7, 1]
    assert tree.beam_nodes.tolist() == [[0, 1, 2, 3]] * 4
    assert torch.equal(tree.mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_same_token_under_different_parents_is_not_merged():
    tree = build_prefix_tree(torch.tensor([[0, 1, 1], [0, 2, 1]]))
    assert tree.tokens.tolist() == [0, 1, 2, 1, 1]
    assert not tree.mask[3, 2] and not tree.mask[4, 1]


def test_root_only_beams():
    tree = build_prefix_tree(torch.tensor([[4], [4]]))
    assert tree.num_nodes == 1 and tree.children == [[]]
    assert tree.mask.tolist() == [[True]]


def test_mismatched_roots_rejected():
    with pytest.raises(ValueError):
        build_prefix_tree(torch.tensor([[1, 2], [3, 2]]))


def test_random_beams_property():
    rng = random.Random(0)
    for _ in range(500):
        num_beams = rng.randint(1, 8)
        draft_len = rng.randint(1, 6)
        vocab = rng.randint(2, 4)  # small vocab forces shared prefixes
        root = rng.randrange(100)
        beams = torch.tensor(
            [[root] + [rng.randrange(vocab) for _ in range(draft_len)] for _ in range(num_beams)]
        )
        tree = build_prefix_tree(beams)
        _check_invariants(tree, beams)
        distinct_prefixes = {tuple(row[: d + 1]) for row in beams.tolist() for d in range(draft_len + 1)}
        assert tree.num_nodes == len(distinct_prefixes)


def test_beams_of_different_lengths_pack_into_one_tree():
    """A longer prompt-lookup beam next to ReDrafter beams: shared prefixes still merge."""
    tree = build_prefix_tree([[7, 1, 2], [7, 3, 4], [7, 1, 2, 5, 6]])
    assert tree.tokens.tolist() == [7, 1, 3, 2, 4, 5, 6]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 3, 5]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 3, 4]
    assert tree.beam_nodes.tolist() == [[0, 1, 3, -1, -1], [0, 2, 4, -1, -1], [0, 1, 3, 5, 6]]
    assert tree.mask[6].nonzero().flatten().tolist() == [0, 1, 3, 5, 6]
    with pytest.raises(ValueError, match="root"):
        build_prefix_tree([[7, 1], [8, 1, 2]])
