"""``GrammarCompiler``: a ``GrammarSpec`` compiled against the model's tokenizer, with an LRU cache.

The grammar engine is xgrammar (Dong et al., "XGrammar: Flexible and Efficient Structured
Generation Engine for Large Language Models", arXiv 2411.15115): a pushdown automaton whose
context-independent tokens are precomputed per grammar state at compile time, so a mask fill only
checks the few context-dependent tokens. See workers/README.md "Structured outputs: grammar engine"
for why xgrammar and its measured costs.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import xgrammar
from transformers import PreTrainedTokenizerBase

from workers.structured.errors import GrammarError
from workers.structured.spec import GrammarSpec

# At most this many whitespace characters between JSON tokens: unbounded whitespace lets a model
# (a small one especially) loop on spaces and newlines until max_tokens; 32 still allows
# pretty-printing to nesting depth ~7 at 4-space indent.
JSON_MAX_WHITESPACE = 32

_LIBRARY_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[15:29:34] /project/cpp/x.cc:94: "


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A compiled grammar, shared by every request with the same spec (read-only).

    spec: what it was compiled from. vocab_size: the logits width its masks have.
    stop_token_ids: the tokens that end the output once the grammar is complete.
    """

    spec: GrammarSpec
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int]  # never allowed: added/special tokens and padded ids
    grammar: xgrammar.CompiledGrammar


class GrammarCompiler:
    """Compiles ``GrammarSpec``s for one tokenizer and logits width; caches the last ``cache_size``.

    Args:
        tokenizer: the model's Hugging Face tokenizer (``workers.models.tokenizer.load_tokenizer``).
        vocab_size: the model's logits width; ids at or above the tokenizer's vocabulary (padding
            rows of the LM head) are never allowed.
        stop_token_ids: the tokens that end generation (the engine's ``eos_token_ids``); allowed
            only where the grammar is complete. Default: the tokenizer's ``eos_token_id``.
        cache_size: compiled grammars kept (LRU).

    Thread-safe: ``compile`` may run on any thread (e.g. off the engine thread, as a cold JSON
    schema costs milliseconds); two threads compiling the same new spec both compile it once.

    Raises:
        ValueError: no stop token (none given and the tokenizer has no ``eos_token_id``).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, *,
                 stop_token_ids: list[int] | None = None, cache_size: int = 256):
        if stop_token_ids is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer has no eos_token_id; pass stop_token_ids")
            stop_token_ids = [tokenizer.eos_token_id]
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(sorted(set(stop_token_ids)))
        self._info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(self.stop_token_ids))
        self._special = frozenset(self._info.special_token_ids) - set(self.stop_token_ids)
        # Our LRU is keyed by spec; the library's own cache (keyed by text, unbounded) is off.
        self._compiler = xgrammar.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar for ``spec`` (cached).

        Raises:
            GrammarError: the schema, regex or grammar cannot be compiled; the message names the
                kind and the library's reason (e.g. ``json_schema: Unsupported type "foo"``).
        """
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        compiled = CompiledGrammar(spec, self.vocab_size, self.stop_token_ids, self._special, self._build(spec))
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        c = self._compiler
        try:
            if spec.kind == "json_object":  # any keys: strict_mode=False
                return c.compile_json_schema('{"type":"object"}', strict_mode=False,
                                             max_whitespace_cnt=JSON_MAX_WHITESPACE)
            if spec.kind == "json_schema":  # properties the schema does not list are not generated
                return c.compile_json_schema(spec.value, max_whitespace_cnt=JSON_MAX_WHITESPACE)
            if spec.kind == "regex":
                return c.compile_regex(spec.value)
            if spec.kind == "choice":
                return c.compile_grammar(choice_ebnf(spec.choices))
            if spec.kind == "structural_tag":
                return c.compile_structural_tag(spec.value)
            return c.compile_grammar(spec.value) if spec.is_ebnf else c.compile_lark(spec.value)
        except (RuntimeError, ValueError) as e:  # InvalidStructuralTagError, InvalidJSONError, compile errors
            reason = _LIBRARY_LOCATION.sub("", str(e).strip())
            raise GrammarError(f"cannot compile {spec.kind}: {reason}") from None


def choice_ebnf(options: tuple[str, ...]) -> str:
    """EBNF whose language is exactly ``options``: ``root ::= "a" | "b"`` (JSON string escapes,
    which xgrammar's EBNF literals accept)."""
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
