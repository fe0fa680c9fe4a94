"""Tool calling: the grammar that constrains a reply's tool calls, and the parsing of generated
``<tool_call>`` blocks (the prompt format of :mod:`workers.models.tool_prompt`) into OpenAI's ``tool_calls``.

Grammar (xgrammar structural tags, :class:`workers.structured.spec.GrammarSpec` ``structural_tag``):
each tool is a tag ``<tool_call>\\n{"name": <its name>, "arguments": <its parameters' schema>}\\n</tool_call>``.

- ``auto``: free text; once the model opens ``<tool_call>`` what follows must be a call of one of the
  tools with valid arguments, and the block must close;
- ``required``: the reply is one or more such blocks (at least one), separated by newlines, and
  nothing else;
- a named function: exactly one block, for that function, and nothing else;
- ``parallel_tool_calls: false``: at most one block.

Parsing never loses text: a block that does not parse (only possible when ``max_tokens`` cut it, or
without a grammar) stays in ``content``, as does all text outside blocks.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from workers.models.tool_prompt import TOOL_CALL_BEGIN, TOOL_CALL_END
from workers.structured.spec import GrammarSpec

ANY_OBJECT = {"type": "object"}
CALL_MAX_WHITESPACE = 16
"""Most consecutive whitespace characters inside a call's JSON (a model, a small one especially, may
otherwise loop on whitespace; 16 still allows 4-space indentation three levels deep)."""


def tool_grammar(tools: list[dict], tool_choice: str | dict, parallel: bool) -> GrammarSpec:
    """The structural-tag grammar for ``tools`` (OpenAI's list, as dicts) under ``tool_choice``
    (``auto``, ``required`` or a named function; not ``none``)."""
    if isinstance(tool_choice, dict):
        chosen = [t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]
        at_least_one, one = True, True
    else:
        chosen, at_least_one, one = tools, tool_choice == "required", not parallel
    tags = [{"type": "tag", "begin": f"{TOOL_CALL_BEGIN}\n", "end": f"\n{TOOL_CALL_END}",
             "content": {"type": "json_schema", "max_whitespace_cnt": CALL_MAX_WHITESPACE, "json_schema": {
                 "type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                 "properties": {"name": {"const": t["function"]["name"]},
                                "arguments": t["function"].get("parameters") or ANY_OBJECT}}}}
            for t in chosen]
    if at_least_one:  # the reply is calls only, one per line, then EOS
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": one}
    else:  # free text; what follows an opening tag is a call
        fmt = {"type": "triggered_tags", "triggers": [TOOL_CALL_BEGIN], "tags": tags, "at_least_one": False,
               "stop_after_first": one}
    return GrammarSpec.structural_tag({"type": "structural_tag", "format": fmt})


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_block(inner: str) -> dict | None:
    """``{"id", "type", "function": {"name", "arguments"}}`` from a block's text, or None when it is not
    a JSON object with a string ``name`` and an object ``arguments``."""
    try:
        call = json.loads(inner)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments", {}), dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a whole reply: calls from its parsable blocks, in order; content is
    everything else (blocks that do not parse included), stripped, None when empty."""
    stream = ToolCallStream()
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    content = (content + rest).strip()
    return content or None, calls + more


@dataclass
class ToolCallStream:
    """Splits a streamed reply into content deltas and complete tool calls.

    Text outside blocks streams as it comes, less a tail that may be the start of ``<tool_call>``
    (withheld until it is not); a block is held until it closes, then becomes a call (or, if it does
    not parse, content). Each call is sent whole, in one delta (OpenAI clients accumulate deltas).
    """

    _buffer: str = ""
    _in_block: bool = False
    index: int = 0
    calls: list[dict] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """New text in; (content to send now, calls completed now)."""
        self._buffer += text
        content, calls = [], []
        while True:
            if not self._in_block:
                start = self._buffer.find(TOOL_CALL_BEGIN)
                if start < 0:
                    keep = _partial_suffix(self._buffer, TOOL_CALL_BEGIN)
                    content.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
                self._in_block = True
            end = self._buffer.find(TOOL_CALL_END)
            if end < 0:
                break
            block = self._buffer[: end + len(TOOL_CALL_END)]
            self._buffer = self._buffer[end + len(TOOL_CALL_END):]
            self._in_block = False
            call = parse_block(block[len(TOOL_CALL_BEGIN): -len(TOOL_CALL_END)].strip())
            if call is None:
                content.append(block)
            else:
                call["index"] = self.index
                self.index += 1
                calls.append(call)
        self.calls.extend(calls)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict]]:
        """End of the reply: what is still held (an unclosed block or a partial tag) is content."""
        rest, self._buffer, self._in_block = self._buffer, "", False
        return rest, []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
