"""``GrammarSpec``: what a request's output must match (JSON object, JSON schema, regex, choice,
grammar), as plain hashable data.

Torch-free and library-free: the HTTP ingress builds and validates specs; the engine compiles them
(``compiler.GrammarCompiler``), using the spec as the cache key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from workers.structured.errors import GrammarError

GrammarKind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """A structured-output constraint.

    ``value`` by ``kind``:
      - ``json_object``: ``""`` (any JSON object);
      - ``json_schema``: the schema as canonical JSON text (``canonical_json``); key order is kept,
        because an object's properties are generated in the schema's order;
      - ``regex``: the pattern (ECMAScript-like syntax, as in OpenAI/vLLM ``guided_regex``);
      - ``choice``: a JSON list of the allowed strings (``'["yes","no"]'``);
      - ``grammar``: EBNF (GBNF, rules ``name ::= ...``, root rule ``root``) or Lark (root rule
        ``start``); text containing ``::=`` is read as EBNF, anything else as Lark;
      - ``structural_tag``: xgrammar's structural tag as canonical JSON text (free text with tagged
        sections whose content is constrained, e.g. tool calls ``<tool_call>{json}</tool_call>``).

    Build one with the constructors (``json_schema``, ``regex``, ...), which check the value;
    the grammar itself is checked when compiled.

    Raises:
        GrammarError: unknown ``kind``, or a ``value`` that does not fit it.
    """

    kind: GrammarKind
    value: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if not isinstance(self.value, str):
            raise GrammarError(f"{self.kind} value must be a string, got {type(self.value).__name__}")
        if self.kind == "json_object" and self.value:
            raise GrammarError("json_object takes no value")
        if self.kind in ("regex", "grammar") and not self.value:
            raise GrammarError(f"{self.kind} must not be empty")
        if self.kind in ("json_schema", "structural_tag"):
            _parse_schema(self.value)
        if self.kind == "choice":
            _parse_choices(self.value)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """Any JSON object (OpenAI ``response_format: {"type": "json_object"}``)."""
        return cls("json_object", "")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> GrammarSpec:
        """JSON matching ``schema`` (a dict, or its JSON text), stored as canonical JSON text.

        Raises:
            GrammarError: the text is not JSON, or the schema is not a JSON object.
        """
        if isinstance(schema, str):
            schema = _parse_schema(schema)
        elif not isinstance(schema, dict):
            raise GrammarError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        return cls("json_schema", canonical_json(schema))

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        """Text matching the whole of ``pattern``."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> GrammarSpec:
        """Exactly one of ``options`` (non-empty list of strings).

        Raises:
            GrammarError: empty, or not all strings.
        """
        if isinstance(options, str) or not all(isinstance(o, str) for o in options):
            raise GrammarError("choice must be a list of strings")
        return cls("choice", canonical_json(list(options)))

    @classmethod
    def grammar(cls, text: str) -> GrammarSpec:
        """Text derived from an EBNF (GBNF) or Lark grammar; see the class docstring."""
        return cls("grammar", text)

    @classmethod
    def structural_tag(cls, tag: dict[str, Any]) -> GrammarSpec:
        """xgrammar's structural tag (``{"type": "structural_tag", "format": {...}}``); checked when compiled."""
        return cls("structural_tag", canonical_json(tag))

    @property
    def choices(self) -> tuple[str, ...]:
        """The options of a ``choice`` spec.

        Raises:
            GrammarError: the spec is not a ``choice``.
        """
        if self.kind != "choice":
            raise GrammarError(f"a {self.kind} spec has no choices")
        return tuple(_parse_choices(self.value))

    @property
    def is_ebnf(self) -> bool:
        """True for a ``grammar`` spec written in EBNF (GBNF), False for Lark or other kinds."""
        return self.kind == "grammar" and "::=" in self.value


def canonical_json(value: Any) -> str:
    """Compact JSON text (no spaces, non-ASCII kept); object key order is kept, not sorted."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _parse_schema(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError(f"json_schema must be a JSON object, got {type(schema).__name__}")
    return schema


def _parse_choices(text: str) -> list[str]:
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"choice is not a JSON list: {e}") from None
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        raise GrammarError("choice must be a list of strings")
    if not options:
        raise GrammarError("choice must list at least one string")
    return options
