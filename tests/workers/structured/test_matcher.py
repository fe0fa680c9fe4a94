import json
import random

import jsonschema
import pytest
import torch

from workers.structured.errors import GrammarError
from workers.structured.mask import apply_allowed
from workers.structured.matcher import RequestGrammar
from workers.structured.spec import GrammarSpec

# Nullable optional fields (type list, anyOf with null), an enum; strings bounded so that random
# logits (which rarely pick a closing quote among ~49k allowed tokens) end them.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": ["integer", "null"]},
        "email": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "color"],
    "additionalProperties": False,
}
DOC = {"name": "Alice", "age": None, "email": "a@b.co", "color": "green"}


def _encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
def schema_grammar(compiler):
    return RequestGrammar(compiler.compile(GrammarSpec.json_schema(SCHEMA)))


def test_valid_json_walks_token_by_token_and_eos_only_at_the_end(schema_grammar, tokenizer):
    eos = tokenizer.eos_token_id
    for token in _encode(tokenizer, json.dumps(DOC)):
        allowed = schema_grammar.allowed()
        assert allowed[token] and not allowed[eos] and not schema_grammar.done
        assert schema_grammar.advance([token]) == 1
    assert schema_grammar.allowed().nonzero().flatten().tolist() == [eos]
    assert schema_grammar.done and not schema_grammar.is_terminated
    assert schema_grammar.advance([eos, 17, 18]) == 1  # tokens after the stop token are ignored
    assert schema_grammar.is_terminated and schema_grammar.allowed().all()


def test_invalid_tokens_are_not_allowed_and_advance_rejects_them(schema_grammar, tokenizer):
    assert not schema_grammar.allowed()[_encode(tokenizer, "Hello")[0]]
    prefix = _encode(tokenizer, '{"name": "Al", "color": "')
    schema_grammar.advance(prefix)
    allowed = schema_grammar.allowed()
    assert allowed[_encode(tokenizer, "green")[0]]
    purple = _encode(tokenizer, "purple")[0]
    assert not allowed[purple]
    before = schema_grammar.allowed()
    with pytest.raises(GrammarError, match="not allowed by the request's json_schema grammar"):
        schema_grammar.advance([_encode(tokenizer, "green")[0], purple])
    assert torch.equal(schema_grammar.allowed(), before)  # a failed advance commits nothing


def _fresh_rows(compiler, spec, committed, tokens, parents):
    """Row i from a fresh matcher advanced along root -> i (None where a token is rejected)."""
    rows = []
    for node in range(len(tokens)):
        path = []
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        grammar = RequestGrammar(compiler.compile(spec))
        grammar.advance(committed)
        try:
            grammar.advance(path[::-1])
        except GrammarError:
            rows.append(None)
            continue
        rows.append(grammar.allowed())
    return rows


def test_tree_allowed_equals_fresh_matchers_along_each_path(compiler, tokenizer):
    spec = GrammarSpec.json_schema(SCHEMA)
    committed = _encode(tokenizer, '{"name": "Al", "color"')
    ids = {text: _encode(tokenizer, text) for text in (':', ' "', 'green', 'gre', 'en', 'Hello', '":', '"}', 'red')}
    assert all(len(v) == 1 for v in ids.values()), ids
    t = {text: v[0] for text, v in ids.items()}
    #  0 (root: 'color')
    #  ├─1 ':' ─ 4 ' "' ─ 7 'green' ─ 10 '"}' ─ 12 EOS
    #  │                 ├ 8 'gre' ─ 11 'en'
    #  │                 └ 9 'Hello' (rejected) ─ 13 '"}'
    #  ├─2 '":' (rejected) ─ 5 ' "'
    #  └─3 'Hello' (rejected) ─ 6 ':'
    tokens = [0, t[':'], t['":'], t['Hello'], t[' "'], t[' "'], t[':'], t['green'], t['gre'], t['Hello'],
              t['"}'], t['en'], tokenizer.eos_token_id, t['"}']]
    parents = [-1, 0, 0, 0, 1, 2, 3, 4, 4, 4, 7, 8, 10, 9]
    grammar = RequestGrammar(compiler.compile(spec))
    grammar.advance(committed)
    before = grammar.allowed()

    rows = grammar.tree_allowed(tokens, parents)

    assert rows.shape == (len(tokens), len(tokenizer)) and rows.dtype == torch.bool
    fresh = _fresh_rows(compiler, spec, committed, tokens, parents)
    rejected = {2, 3, 5, 6, 9, 13}
    for node, expected in enumerate(fresh):
        if node in rejected:
            assert expected is None and rows[node].all(), node  # unreachable: all-True
        elif node == 12:  # after EOS the output has ended: all-True
            assert rows[node].all()
        else:
            assert torch.equal(rows[node], expected), node
    assert rows[10].nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert torch.equal(grammar.allowed(), before)  # the committed state is unchanged
    assert not grammar.is_terminated
    grammar.advance([t[':'], t[' "'], t['green'], t['"}']])  # and still advances from it
    assert grammar.done


def test_tree_allowed_rejects_malformed_trees(schema_grammar):
    for tokens, parents in (([1, 2], [-1]), ([1, 2], [0, 0]), ([1, 2, 3], [-1, 2, 0]), ([], [])):
        with pytest.raises(ValueError):
            schema_grammar.tree_allowed(tokens, parents)


def test_regex(compiler, tokenizer):
    spec = GrammarSpec.regex(r"[0-9]{3}-[a-z]+")
    grammar = RequestGrammar(compiler.compile(spec))
    grammar.advance(_encode(tokenizer, "123-ab"))
    assert grammar.allowed()[tokenizer.eos_token_id] and not grammar.done
    grammar = RequestGrammar(compiler.compile(spec))
    grammar.advance(_encode(tokenizer, "12"))
    assert not grammar.allowed()[_encode(tokenizer, "a")[0]]
    assert not grammar.allowed()[tokenizer.eos_token_id]


def test_choice(compiler, tokenizer):
    options = ["yes", "no", 'say "hi"', "naïve"]
    spec = GrammarSpec.choice(options)
    for option in options:
        grammar = RequestGrammar(compiler.compile(spec))
        grammar.advance(_encode(tokenizer, option))
        assert grammar.done
    grammar = RequestGrammar(compiler.compile(spec))
    assert not grammar.allowed()[_encode(tokenizer, "maybe")[0]]


def test_json_object_allows_any_keys(compiler, tokenizer):
    grammar = RequestGrammar(compiler.compile(GrammarSpec.json_object()))
    assert not grammar.allowed()[_encode(tokenizer, "[")[0]]
    grammar.advance(_encode(tokenizer, '{"anything": [1, {"x": null}]}'))
    assert grammar.done


def _greedy(grammar, logits_of, max_tokens=300):
    """Plain greedy decoding over ``logits_of(output so far)`` masked by the grammar."""
    out = []
    while not grammar.is_terminated and len(out) < max_tokens:
        token = int(apply_allowed(logits_of(out)[None], grammar.allowed()[None]).argmax())
        grammar.advance([token])
        out.append(token)
    return out


def _random_logits(seed, vocab_size):
    """Logits that are a fixed random function of the output so far."""
    def logits_of(path):
        return torch.randn(vocab_size, generator=torch.Generator().manual_seed(hash((seed, *path)) % 2**63))
    return logits_of


@pytest.mark.parametrize("seed", range(12))
def test_greedy_over_random_logits_always_validates(compiler, tokenizer, seed):
    grammar = RequestGrammar(compiler.compile(GrammarSpec.json_schema(SCHEMA)))
    out = _greedy(grammar, _random_logits(seed, len(tokenizer)))
    assert grammar.is_terminated and out[-1] == tokenizer.eos_token_id
    jsonschema.validate(json.loads(tokenizer.decode(out[:-1])), SCHEMA)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_tree_acceptance_equals_plain_greedy(compiler, tokenizer, seed):
    """Speculative steps with masked tree logits emit exactly the plain greedy output."""
    spec, vocab_size = GrammarSpec.json_schema(SCHEMA), len(tokenizer)
    logits_of = _random_logits(seed, vocab_size)
    plain = _greedy(RequestGrammar(compiler.compile(spec)), logits_of)
    rng = random.Random(seed)
    grammar, out, steps = RequestGrammar(compiler.compile(spec)), [], 0
    while not grammar.is_terminated and len(out) < 300:
        steps += 1
        # Draft tree: per node up to 2 children, the greedy-correct token (sometimes) and a random one.
        tokens, parents = [0], [-1]
        frontier = [(0, out)]
        for _ in range(3):
            nxt = []
            for node, path in frontier:
                greedy = int(apply_allowed(logits_of(path)[None], _allowed_after(compiler, spec, path)).argmax())
                for token in {greedy if rng.random() < 0.7 else rng.randrange(vocab_size), rng.randrange(vocab_size)}:
                    tokens.append(token)
                    parents.append(node)
                    nxt.append((len(tokens) - 1, path + [token]))
            frontier = nxt
        rows = grammar.tree_allowed(tokens, parents)
        node, path, accepted = 0, list(out), []
        while True:  # greedy acceptance along the tree (ReDrafter arXiv 2403.09919 Sec. 3.3)
            token = int(apply_allowed(logits_of(path)[None], rows[node][None]).argmax())
            accepted.append(token)
            path.append(token)
            child = next((c for c in range(len(tokens)) if parents[c] == node and tokens[c] == token), None)
            if child is None:
                break
            node = child
        committed = grammar.advance(accepted)
        out += accepted[:committed]
    assert out == plain
    assert steps < len(plain) / 1.5  # drafts were accepted: the check covered multi-token steps


def _allowed_after(compiler, spec, path):
    """``[1, vocab_size]``: what the grammar allows after ``path`` (all-True if it rejects it)."""
    grammar = RequestGrammar(compiler.compile(spec))
    try:
        grammar.advance(path)
    except GrammarError:
        return torch.ones(1, grammar.vocab_size, dtype=torch.bool)
    return grammar.allowed()[None]
