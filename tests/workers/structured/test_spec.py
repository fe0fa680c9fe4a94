import json
import subprocess
import sys

import pytest

from workers.structured.errors import GrammarError
from workers.structured.spec import GrammarSpec


def test_json_schema_is_canonical_keeps_key_order_and_is_a_cache_key():
    a = GrammarSpec.json_schema({"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}})
    b = GrammarSpec.json_schema('{ "type": "object",\n "properties": {"z": {"type": "string"}, "a": {"type": "integer"}} }')
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.value == '{"type":"object","properties":{"z":{"type":"string"},"a":{"type":"integer"}}}'
    assert list(json.loads(a.value)["properties"]) == ["z", "a"]  # generation order, not sorted


def test_constructors():
    assert GrammarSpec.json_object() == GrammarSpec("json_object", "")
    assert GrammarSpec.regex(r"\d+") == GrammarSpec("regex", r"\d+")
    choice = GrammarSpec.choice(["yes", "no", 'say "hi"'])
    assert choice.value == '["yes","no","say \\"hi\\""]' and choice.choices == ("yes", "no", 'say "hi"')
    assert GrammarSpec.grammar('root ::= "a"').is_ebnf and not GrammarSpec.grammar('start: "a"').is_ebnf


@pytest.mark.parametrize("make, message", [
    (lambda: GrammarSpec.json_schema("{not json"), "not valid JSON"),
    (lambda: GrammarSpec.json_schema("[1, 2]"), "must be a JSON object"),
    (lambda: GrammarSpec.json_schema(["a"]), "must be a JSON object"),
    (lambda: GrammarSpec.choice([]), "at least one"),
    (lambda: GrammarSpec.choice("yes"), "list of strings"),
    (lambda: GrammarSpec.choice(["a", 1]), "list of strings"),
    (lambda: GrammarSpec("choice", '{"a": 1}'), "list of strings"),
    (lambda: GrammarSpec.regex(""), "must not be empty"),
    (lambda: GrammarSpec("json_object", "{}"), "takes no value"),
    (lambda: GrammarSpec("xml", ""), "unknown grammar kind"),
    (lambda: GrammarSpec.regex("a").choices, "has no choices"),
])
def test_bad_values_raise_grammar_error(make, message):
    with pytest.raises(GrammarError, match=message):
        make()
    assert issubclass(GrammarError, ValueError)


def test_spec_imports_neither_torch_nor_the_grammar_library():
    code = ("import sys, workers.structured.spec; "
            "print([m for m in ('torch', 'xgrammar', 'numpy') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
