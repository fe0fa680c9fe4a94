"""What the ingress and a replica send each other: the request, and the stream items around the engine's
:class:`~workers.outputs.GenerationDelta` (``Started`` first, or one ``Failed``).

Plain data with no torch or engine import, so the HTTP ingress and the request router that runs inside
every ``DeploymentHandle`` can use them without loading the engine (checked by tests/test_import_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """A generation request as a replica sees it, free of HTTP/OpenAI details.

    Exactly one of ``prompt`` (raw text) and ``messages`` (rendered with the chat template) is set.
    ``max_tokens`` None means the default budget (see ``cluster.ingress.protocol.resolve_max_tokens``); the
    resolved budget replaces ``sampling.max_tokens``. ``max_tokens_field`` names the request field in
    error messages. ``mode``: the requested mode (``rdserve.mode``) or None. ``grammar_field``: the
    request field that set ``sampling.grammar`` (named in a 400 when it does not compile), or None.
    ``tools``: OpenAI's function tools for the chat template (:mod:`workers.models.tool_prompt`), or None.
    """

    prompt: str | None
    messages: list[dict] | None
    sampling: SamplingParams
    max_tokens: int | None
    max_tokens_field: str
    mode: str | None
    grammar_field: str | None = None
    tools: list[dict] | None = None


@dataclass(frozen=True)
class Started:
    """First stream item of an accepted request (sent with its first token, right before it): prompt
    size, the router's decision, and the Serve id of the replica that serves it."""

    prompt_tokens: int
    mode: str
    reason: str
    replica: str


@dataclass(frozen=True)
class Failed:
    """Last stream item of a failed request; ``status`` 400 (bad request) or 500 (engine error)."""

    status: int
    message: str
    param: str | None = None
