import pytest

from workers.structured.compiler import GrammarCompiler
from workers.structured.errors import GrammarError
from workers.structured.matcher import RequestGrammar
from workers.structured.spec import GrammarSpec


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec.regex("a(b"), r"cannot compile regex: .*parenthesis is not closed"),
    (GrammarSpec.json_schema({"type": "foo"}), r'cannot compile json_schema: Unsupported type "foo"'),
    (GrammarSpec.json_schema({"properties": {"a": {"$ref": "#/nope"}}}), r"cannot compile json_schema: .*nope"),
    (GrammarSpec.grammar("root ::= foo"), r'cannot compile grammar: .*Rule "foo" is not defined'),
    (GrammarSpec.grammar("start: foo"), r"cannot compile grammar: .*unknown name 'foo'"),
])
def test_compile_errors_name_the_problem(compiler, spec, message):
    with pytest.raises(GrammarError, match=message) as info:
        compiler.compile(spec)
    assert "/project/cpp" not in str(info.value)  # the library's source location is stripped


def test_compiled_grammars_are_cached_lru(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), cache_size=2)
    a, b, c = (GrammarSpec.regex(p) for p in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(GrammarSpec.regex("a+")) is first
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recent, so c evicts b
    compiler.compile(c)
    assert compiler.compile(a) is first
    assert compiler._cache.keys() == {a, c}


def test_padded_vocab_ids_are_never_allowed(tokenizer):
    vocab_size = len(tokenizer) + 64  # an LM head padded past the tokenizer's vocabulary
    compiler = GrammarCompiler(tokenizer, vocab_size)
    grammar = RequestGrammar(compiler.compile(GrammarSpec.regex(".*")))
    allowed = grammar.allowed()
    assert allowed.shape == (vocab_size,)
    assert allowed[: len(tokenizer)].sum() > 40000 and not allowed[len(tokenizer):].any()
    assert grammar.tree_allowed([0, len(tokenizer) + 3], [-1, 0])[1].all()  # rejected node: all-True row


def test_stop_tokens_default_to_eos_and_can_be_given(tokenizer):
    assert GrammarCompiler(tokenizer, len(tokenizer)).stop_token_ids == (tokenizer.eos_token_id,)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), stop_token_ids=[0, tokenizer.eos_token_id])
    grammar = RequestGrammar(compiler.compile(GrammarSpec.choice(["ok"])))
    grammar.advance(tokenizer.encode("ok", add_special_tokens=False))
    assert grammar.allowed().nonzero().flatten().tolist() == [0, tokenizer.eos_token_id]
