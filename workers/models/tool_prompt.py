"""Tools in the prompt: the OpenAI ``tools`` list and a conversation's tool calls and results rendered for
a chat template, natively when the model's template takes ``tools``, else in a generic format.

The generic format is the Hermes-style one (NousResearch Hermes 2 Pro, Qwen2.5, and SmolLM2's
function-calling data: ``<tool_call>`` JSON), for templates such as SmolLM2-135M-Instruct's that have no
tool section:

- the tools' JSON signatures go into the system message, inside ``<tools></tools>``, with the
  instruction to answer a call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- an assistant message's ``tool_calls`` become such blocks after its text;
- ``role: "tool"`` results become a user turn of ``<tool_response>`` blocks (consecutive results are
  one turn), a role every chat template accepts.

The server parses generated ``<tool_call>`` blocks back into ``tool_calls``
(:mod:`cluster.ingress.tools`) and constrains their JSON with a grammar. Plain data, no torch.
"""

from __future__ import annotations

import json

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

_INSTRUCTIONS = (
    "You can call functions to help answer the user. Their signatures, as JSON, are inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one block per call, each holding a JSON object with the function's "
    'name and its arguments:\n<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n</tool_call>\n'
    "Function results come back inside <tool_response></tool_response>."
)


def template_takes_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders a ``tools`` variable itself (Jinja text mentioning it)."""
    return bool(chat_template) and "tools" in chat_template


def call_block(name: str, arguments: str | dict) -> str:
    """One ``<tool_call>`` block; ``arguments`` as JSON text (OpenAI's form) or an object."""
    args = json.loads(arguments) if isinstance(arguments, str) and arguments.strip() else (arguments or {})
    return f'{TOOL_CALL_BEGIN}\n{json.dumps({"name": name, "arguments": args}, ensure_ascii=False)}\n{TOOL_CALL_END}'


def render_generic(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` (OpenAI chat messages as dicts: ``role``, ``content``, and ``tool_calls`` on
    assistant messages) in plain ``{"role", "content"}`` turns with the generic tool format.

    Raises:
        ValueError: a tool call's ``arguments`` is not JSON (names the message).
    """
    out: list[dict] = []
    if tools:
        block = _INSTRUCTIONS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{block}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            result = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
            continue
        content = m.get("content") or ""
        calls = m.get("tool_calls") or []
        if calls:
            try:
                blocks = [call_block(c["function"]["name"], c["function"].get("arguments") or "{}") for c in calls]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"message {i}: a tool call's function.arguments is not a JSON object: {err}") from None
            content = "\n".join(([content] if content else []) + blocks)
        out.append({"role": m["role"], "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]
