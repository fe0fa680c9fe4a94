"""Task checks a prompt's category allows: valid JSON, the final number of a math answer, code that parses.

Each check returns True/False, or None when it does not apply (unknown category, math without a
reference). Categories match by substring: ``json``, ``math`` (or ``gsm``), ``code``.
"""

from __future__ import annotations

import ast
import json
import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*\n(.*?)(?:```|$)", re.S)


def json_is_valid(text: str) -> bool:
    """The answer, or its first fenced block, or its outermost ``{...}``/``[...]`` span, is JSON."""
    candidates = [text.strip(), *(m.strip() for m in _FENCE.findall(text))]
    for open_, close in ("{}", "[]"):
        start, end = text.find(open_), text.rfind(close)
        if 0 <= start < end:
            candidates.append(text[start:end + 1])
    for candidate in candidates:
        try:
            json.loads(candidate)
            return True
        except ValueError:
            continue
    return False


def final_number(text: str) -> float | None:
    """The last number in ``text`` (GSM8K style: ``#### 42`` gives 42); commas dropped."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def math_is_correct(text: str, reference: str) -> bool | None:
    """The answer's final number equals the reference's (its ``#### N`` line, else its last number)."""
    ref = reference.split("####")[-1] if "####" in reference else reference
    expected = final_number(ref)
    if expected is None:
        return None
    got = final_number(text)
    return got is not None and abs(got - expected) < 1e-6


def code_parses(text: str) -> bool:
    """The first fenced code block (or the whole answer) is valid Python (``ast.parse``)."""
    blocks = _FENCE.findall(text)
    try:
        ast.parse(blocks[0] if blocks else text)
        return True
    except (SyntaxError, ValueError):
        return False


def task_check(category: str, text: str, reference: str | None) -> tuple[str, bool] | None:
    """``(check name, passed)`` for the category, or None when no check applies."""
    cat = category.lower()
    if "json" in cat:
        return "valid_json", json_is_valid(text)
    if ("math" in cat or "gsm" in cat) and reference:
        ok = math_is_correct(text, reference)
        return None if ok is None else ("final_number", ok)
    if "code" in cat:
        return "code_parses", code_parses(text)
    return None
