import random

import torch
from scipy.stats import chisquare

from workers.redrafter.acceptance import accept_greedy, accept_sampled
from workers.sampling import sample_keyed
from workers.redrafter.tree import PrefixTree, build_prefix_tree

P_VALUE = 1e-3


def _emitted(tree: PrefixTree, path: list[int], bonus: int) -> list[int]:
    return [int(tree.tokens[node]) for node in path[1:]] + [bonus]


# accept_greedy


def test_greedy_follows_matching_children():
    tree = build_prefix_tree(torch.tensor([[5, 1, 2], [5, 1, 3], [5, 4, 2]]))
    # Nodes: 0:5, 1:1, 2:4, 3:2 (under 1), 4:3 (under 1), 5:2 (under 4).
    assert accept_greedy(tree, [1, 3, 0, 0, 8, 0]) == ([0, 1, 4], 8)
    assert accept_greedy(tree, torch.tensor([4, 0, 2, 0, 0, 7])) == ([0, 2, 5], 7)
    assert accept_greedy(tree, [9, 3, 0, 0, 0, 0]) == ([0], 9)
    assert accept_greedy(tree, [1, 6, 0, 0, 0, 0]) == ([0, 1], 6)


def _longest_matching_beam(beams: list[list[int]], argmax_of) -> list[int]:
    best: list[int] = []
    for beam in beams:
        k = 0
        while k + 1 < len(beam) and beam[k + 1] == argmax_of(tuple(beam[: k + 1])):
            k += 1
        emitted = beam[1 : k + 1] + [argmax_of(tuple(beam[: k + 1]))]
        if len(emitted) > len(best):
            best = emitted
    return best


def test_greedy_equals_longest_matching_beam_prefix():
    rng = random.Random(1)
    for _ in range(500):
        vocab = rng.randint(2, 3)
        table: dict[tuple[int, ...], int] = {}

        def argmax_of(context: tuple[int, ...]) -> int:
            return table.setdefault(context, rng.randrange(vocab))

        draft_len = rng.randint(1, 6)
        beams = [[7] + [rng.randrange(vocab) for _ in range(draft_len)] for _ in range(rng.randint(1, 8))]
        tree = build_prefix_tree(torch.tensor(beams))
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        contexts = []
        for node in range(tree.num_nodes):
            contexts.append((contexts[parents[node]] if node else ()) + (tokens[node],))
        target_argmax = [argmax_of(context) for context in contexts]
        path, bonus = accept_greedy(tree, target_argmax)
        assert path[0] == 0 and all(tree.parents[b] == a for a, b in zip(path, path[1:]))
        assert _emitted(tree, path, bonus) == _longest_matching_beam(beams, argmax_of)


def test_sampled_with_one_hot_target_equals_greedy():
    rng = random.Random(2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        beams = torch.tensor([[0] + [rng.randrange(3) for _ in range(3)] for _ in range(rng.randint(1, 4))])
        tree = build_prefix_tree(beams)
        target_argmax = torch.randint(0, 3, (tree.num_nodes,), generator=generator)
        one_hot = torch.nn.functional.one_hot(target_argmax, 5).float()
        draws = [rng.random() for _ in range(int(tree.depths[-1]) + 1)]
        assert accept_sampled(tree, one_hot, draws) == accept_greedy(tree, target_argmax)


# accept_sampled: statistical tests


def _random_target(num_nodes: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """[num_nodes, vocab] float32, bounded away from 0 except for some zeroed tokens (as top-k does)."""
    dirichlet = torch.distributions.Dirichlet(torch.ones(vocab)).sample((num_nodes,))
    probs = 0.5 * dirichlet + 0.5 / vocab
    zeroed = torch.rand(num_nodes, vocab, generator=generator) < 0.15
    zeroed[:, 0] = False
    probs = probs.masked_fill(zeroed, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def _assert_matches(observed: dict, expected: dict, trials: int) -> None:
    """Chi-square goodness of fit; cells with zero expected mass must be empty, tiny cells merged."""
    for cell, count in observed.items():
        assert expected.get(cell, 0.0) > 0.0 or count == 0, cell
    big = [cell for cell, p in expected.items() if p * trials >= 5]
    small = [cell for cell, p in expected.items() if 0 < p * trials < 5]
    f_obs = [observed.get(cell, 0) for cell in big]
    f_exp = [expected[cell] * trials for cell in big]
    if small:
        f_obs.append(sum(observed.get(cell, 0) for cell in small))
        f_exp.append(sum(expected[cell] for cell in small) * trials)
    scale = sum(f_obs) / sum(f_exp)  # absorb float rounding of the expected total
    assert chisquare(f_obs, [e * scale for e in f_exp]).pvalue > P_VALUE


def test_sampled_keeps_target_distribution_of_first_two_tokens():
    vocab, trials = 6, 15_000
    rng = random.Random(3)
    torch.manual_seed(3)  # the Dirichlet draw
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        num_beams = rng.randint(2, 5)
        beams = torch.tensor([[0] + [rng.randrange(vocab) for _ in range(3)] for _ in range(num_beams)])
        tree = build_prefix_tree(beams)
        target = _random_target(tree.num_nodes, vocab, generator)
        first: dict[int, int] = {}
        pairs: dict[tuple[int, int], int] = {}
        for _ in range(trials):
            path, bonus = accept_sampled(tree, target, [rng.random() for _ in range(4)])
            emitted = _emitted(tree, path, bonus)
            first[emitted[0]] = first.get(emitted[0], 0) + 1
            cell = (path[1], emitted[1]) if len(path) > 1 else "first token not drafted"
            pairs[cell] = pairs.get(cell, 0) + 1
        _assert_matches(first, dict(enumerate(target[0].tolist())), trials)
        # P(first = child c, second = y) = p_root(token of c) * p_c(y); other first tokens pooled.
        expected: dict = {}
        for child in tree.children[0]:
            p_child = target[0, tree.tokens[child]].item()
            for y in range(vocab):
                expected[(child, y)] = p_child * target[child, y].item()
        expected["first token not drafted"] = 1.0 - sum(expected.values())
        _assert_matches(pairs, expected, trials)


def _apple_rule_first_token(p: torch.Tensor, q: torch.Tensor, generator: torch.Generator) -> int:
    """min(1, p/q) with q the drafter's softmax although the draft is its deterministic argmax."""
    x = int(q.argmax())
    if torch.rand((), generator=generator) < min(1.0, float(p[x] / q[x])):
        return x
    residual = (p - q).clamp(min=0.0)
    return int(torch.multinomial(residual, 1, generator=generator))


def test_min_p_over_q_rule_is_biased_for_deterministic_drafts():
    p = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1], dtype=torch.float64)
    q = torch.tensor([0.4, 0.15, 0.15, 0.15, 0.15], dtype=torch.float64)
    tree = build_prefix_tree(torch.tensor([[9, 0]]))
    target = torch.stack([p, p])
    generator = torch.Generator().manual_seed(4)
    rng = random.Random(4)
    trials = 5_000
    exact: dict[int, int] = {}
    biased: dict[int, int] = {}
    for _ in range(trials):
        token = _emitted(tree, *accept_sampled(tree, target, [rng.random(), rng.random()]))[0]
        exact[token] = exact.get(token, 0) + 1
        token = _apple_rule_first_token(p, q, generator)
        biased[token] = biased.get(token, 0) + 1
    expected = [x * trials for x in p.tolist()]
    assert chisquare([exact.get(t, 0) for t in range(5)], expected).pvalue > P_VALUE
    assert chisquare([biased.get(t, 0) for t in range(5)], expected).pvalue < 1e-12


def test_sampled_emits_exactly_the_tokens_plain_sampling_draws():
    """With the same draws, the emitted tokens are those inverse-CDF sampling of the target rows along
    the accepted path gives, whatever the tree: what makes a seeded request's text independent of
    drafting."""
    rng = random.Random(5)
    torch.manual_seed(5)
    generator = torch.Generator().manual_seed(5)
    vocab, accepted_some = 4, 0
    for _ in range(300):
        beams = torch.tensor([[0] + [rng.randrange(vocab) for _ in range(3)] for _ in range(rng.randint(1, 4))])
        tree = build_prefix_tree(beams)
        target = _random_target(tree.num_nodes, vocab, generator)
        draws = [rng.random() for _ in range(4)]
        path, bonus = accept_sampled(tree, target, draws)
        emitted = _emitted(tree, path, bonus)
        assert emitted == [sample_keyed(target[node : node + 1], [draws[d]])[0] for d, node in enumerate(path)]
        accepted_some += len(path) > 1
    assert accepted_some > 50
