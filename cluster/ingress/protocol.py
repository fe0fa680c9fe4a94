"""OpenAI-compatible request and response schemas (chat completions, completions, models).

Extensions beyond the OpenAI API:
- ``top_k`` (int, 0 = off) and ``ignore_eos`` (bool, as in vLLM; for benchmarks) on both request kinds;
- ``rdserve: {"mode": "auto" | "spec" | "plain"}`` on requests forces the decoding mode
  (default: the router's ``default_mode``); with the ``openai`` client pass it via ``extra_body``;
- ``rdserve: {"mode", "reason", "num_steps", "accepted_draft_tokens", "tokens_per_step"}`` on
  responses (streaming: on the chunk that carries ``finish_reason``).

``max_tokens`` absent means 16 for completions (OpenAI's default) and, for chat completions, the
remaining context capped at ``DEFAULT_MAX_TOKENS`` (1024).
Types are strict (``"max_tokens": "5"`` is a 400, not 5). OpenAI fields rdserve does not implement
(``UNSUPPORTED``: logprobs, tools, response_format other than text, penalties, ...), and vLLM's
extensions that clients of vLLM-compatible servers send (``guided_json``, ``structured_outputs``,
``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ...), are accepted only with their "off"
value and otherwise rejected with a 400 naming the field, never silently ignored; other unknown fields (``user``, ``metadata``, ...) are ignored, as OpenAI-compatible
servers commonly do. Text (prompt, message content, stop strings) must be valid Unicode (no lone
UTF-16 surrogate such as JSON ``"\\ud800"``); ``stop`` holds at most ``MAX_STOP_STRINGS`` non-empty
strings of at most ``MAX_STOP_CHARS`` characters (the engine checks every stop string at every token).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, create_model,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from cluster.ingress.tools import tool_grammar
from workers.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from workers.structured.errors import GrammarError
from workers.structured.spec import GrammarSpec

DEFAULT_MAX_TOKENS = 1024
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class RequestError(ValueError):
    """A request the server rejects with HTTP 400; ``param`` is the offending field."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


def error_body(message: str, param: str | None, type_: str = "invalid_request_error", code: str | None = None) -> dict:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


NOT_A_JSON_OBJECT = "the request body must be a JSON object, sent with Content-Type: application/json"


def _is_field_part(part) -> bool:
    """A ``loc`` element that names a field, a list index or a dict key, not a union member's tag
    that pydantic inserts (``literal['none','auto']``, ``NamedToolChoice``, ``dict[str,any]``)."""
    return isinstance(part, int) or (re.fullmatch(r"[a-z0-9_]+", str(part)) is not None and part not in _TYPE_TAGS)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "bytes"}  # pydantic's tags of plain union members


def validation_error(errors: list[dict]) -> RequestError:
    """The 400 for pydantic's validation errors (FastAPI's, their ``loc`` starting with ``"body"``):
    ``param`` is the first bad field; the message names each bad field with pydantic's text, less its
    ``"Value error, "`` prefix (a validator's own message)."""
    fields = [".".join(str(p) for p in e["loc"] if p != "body" and _is_field_part(p)) for e in errors]
    if not fields or not fields[0]:  # the body itself: not JSON sent as JSON, or not an object
        return RequestError(None, f"body: {NOT_A_JSON_OBJECT}")
    message = "; ".join(f"{f}: {e['msg'].removeprefix('Value error, ')}" for f, e in zip(fields, errors))
    return RequestError(fields[0], message)


MAX_PROMPT_CHARS_PER_TOKEN = 32
"""A prompt longer than ``max_seq_len * MAX_PROMPT_CHARS_PER_TOKEN`` characters cannot fit in the
context with any practical tokenizer; it is rejected before tokenization, which would otherwise hold
the engine thread (and every stream on the replica) for seconds."""


def check_prompt_chars(num_chars: int, max_seq_len: int, prompt_field: str) -> None:
    """Raises:
        RequestError: the prompt text is too long to tokenize into the context.
    """
    limit = max_seq_len * MAX_PROMPT_CHARS_PER_TOKEN
    if num_chars > limit:
        raise RequestError(prompt_field, f"{prompt_field}: {num_chars} characters cannot fit in the context of "
                                         f"{max_seq_len} tokens (at most {limit} characters are accepted)")


def resolve_max_tokens(requested: int | None, prompt_tokens: int, max_seq_len: int, *,
                       prompt_field: str, max_tokens_field: str) -> int:
    """Completion budget in tokens, checked against the context length (prompt + completion).

    Raises:
        RequestError: the prompt is empty or leaves no room, or ``requested`` exceeds the room left.
    """
    if prompt_tokens == 0:
        raise RequestError(prompt_field, f"{prompt_field}: the prompt is empty (0 tokens)")
    remaining = max_seq_len - prompt_tokens
    if remaining < 1:
        raise RequestError(
            prompt_field,
            f"{prompt_field}: the prompt has {prompt_tokens} tokens; the context length is {max_seq_len} tokens "
            "and at least one must be left for the completion",
        )
    if requested is None:
        return min(remaining, DEFAULT_MAX_TOKENS)
    if requested > remaining:
        raise RequestError(
            max_tokens_field,
            f"{max_tokens_field}: {requested} completion tokens + {prompt_tokens} prompt tokens exceed the "
            f"context length of {max_seq_len} tokens",
        )
    return requested


def fit_kv_cache(max_tokens: int, prompt_tokens: int, kv_tokens: int, *, defaulted: bool,
                 prompt_field: str, max_tokens_field: str) -> int:
    """Completion budget checked against the whole paged KV cache of ``kv_tokens`` slots: a request
    needs ``prompt_tokens + max_tokens - 1`` at its longest (``workers.sequence.Sequence.max_slots``).
    A ``defaulted`` budget (the client sent none) is cut to what fits.

    Raises:
        RequestError: the prompt alone does not fit (names the prompt field), or with ``max_tokens``
            completion tokens it does not (names ``max_tokens_field``).
    """
    room = kv_tokens - prompt_tokens + 1
    if room < 1:
        raise RequestError(prompt_field, f"{prompt_field}: the prompt has {prompt_tokens} tokens; the KV cache "
                                         f"holds {kv_tokens} tokens")
    if max_tokens <= room or defaulted:
        return min(max_tokens, room)
    raise RequestError(
        max_tokens_field,
        f"{max_tokens_field}: {max_tokens} completion tokens + {prompt_tokens} prompt tokens need "
        f"{prompt_tokens + max_tokens - 1} KV cache slots; the cache holds {kv_tokens} "
        f"(at most {room} completion tokens with this prompt)",
    )


# OpenAI request fields rdserve does not implement, with the values that mean "not used".
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (None, 1), "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]), "audio": (None,),
    # vLLM's extensions, which clients of vLLM-compatible servers send: each changes what the request
    # means, so it is honoured or refused, never ignored
    "guided_decoding_backend": (None, "xgrammar", "auto"), "guided_whitespace_pattern": (None,),
    "min_p": (None, 0, 0.0),
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0), "bad_words": (None, []),
    "allowed_token_ids": (None,), "logits_processors": (None,), "truncate_prompt_tokens": (None,),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "documents": (None,),
}


# vLLM's chat ``echo`` (repeat the last message) is not implemented; completions' ``echo`` is. Tools are
# chat's (completions have none).
CHAT_UNSUPPORTED: dict[str, tuple] = {**{k: v for k, v in UNSUPPORTED.items() if k not in ("tools", "tool_choice")},
                                      "echo": (None, False)}
# /v1/completions has no ``top_logprobs``: its ``logprobs`` is the count of alternatives.
COMPLETION_UNSUPPORTED: dict[str, tuple] = {**UNSUPPORTED, "top_logprobs": (None,)}

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256


def _valid_unicode(text: str) -> str:
    """Raises:
        ValueError: ``text`` holds a lone UTF-16 surrogate (JSON ``"\\ud800"``), which is not Unicode
            text: no tokenizer can encode it.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"invalid text: a lone UTF-16 surrogate (U+{ord(text[err.start]):04X}) at character "
                         f"{err.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``. ``strict`` is accepted either way: rdserve always
    generates only the properties the schema lists (what ``strict: true`` asks for; valid either way)."""

    model_config = ConfigDict(strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    model_config = ConfigDict(strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its constraints."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class RdserveOptions(BaseModel):
    """``mode``: force the decoding mode. ``cache_salt``: share prefix-cache blocks only with requests
    of the same salt (as vLLM's top-level ``cache_salt``, which is accepted too)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    mode: Literal["auto", "spec", "plain"] | None = None
    cache_salt: str | None = Field(None, min_length=1)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


# One optional field per unsupported name, so a rejection names the field (``_not_implemented``).
_ANY_UNSUPPORTED = {**CHAT_UNSUPPORTED, **COMPLETION_UNSUPPORTED}
_UnsupportedFields = create_model("_UnsupportedFields", **{name: (Any, None) for name in _ANY_UNSUPPORTED})

MAX_LOGPROBS = MAX_TOP_LOGPROBS  # alternatives per token (OpenAI's top_logprobs limit; vLLM's max_logprobs)


class _GenerationRequest(_UnsupportedFields):
    model_config = ConfigDict(extra="ignore", strict=True)
    unsupported: ClassVar[dict[str, tuple]] = UNSUPPORTED

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: list[Text] | None = None  # a single string is a list of one (``_stop_list``)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    rdserve: RdserveOptions | None = None
    # logits processors (OpenAI; vLLM's extensions), see workers.sampling_params.SamplingParams
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # vLLM's only bound is > 0; a denormal one (5e-324) divides logits to inf, so 0.01-100 (far beyond use)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    cache_salt: str | None = Field(None, min_length=1)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* (at most one)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _grammar: tuple[str, GrammarSpec] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _one_grammar(self):
        """Builds the request's grammar (``self.grammar``, ``self.grammar_field``).

        Raises:
            ValidationError: more than one structured-output field, or a value that is not a
                grammar (bad JSON text, an empty regex or choice), reported on that field.
        """
        if self.cache_salt and self.rdserve and self.rdserve.cache_salt and self.cache_salt != self.rdserve.cache_salt:
            raise _field_error("cache_salt", f"{self.cache_salt!r} differs from rdserve.cache_salt "
                                             f"{self.rdserve.cache_salt!r}; give one of them (or the same value)")
        found = [(name, spec) for name, spec in self._grammar_specs() if spec is not None]
        if len(found) > 1:
            raise _field_error(found[1][0], f"only one structured-output field may be given; {found[0][0]} is too")
        if found and self.ignore_eos:
            raise _field_error("ignore_eos", f"cannot be combined with {found[0][0]}: a structured output ends "
                                             "where its grammar does")
        self._grammar = found[0] if found else None
        return self

    def _grammar_specs(self):
        """``(field, GrammarSpec | None)`` for each structured-output field that is set."""
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            if fmt.type == "json_schema" and fmt.json_schema is None:
                raise _field_error("response_format", "type json_schema needs json_schema.schema")
            yield "response_format", _spec("response_format", GrammarSpec.json_object) if fmt.type == "json_object" \
                else _spec("response_format", GrammarSpec.json_schema, fmt.json_schema.schema_)
        so = self.structured_outputs
        if so is not None:
            given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                         ("grammar", so.grammar)) if v is not None]
            if so.json_object:
                given.append(("json_object", None))
            if len(given) != 1:
                raise _field_error("structured_outputs", f"give exactly one of json, regex, choice, grammar, json_object "
                                                         f"(got {', '.join(k for k, _ in given) or 'none'})")
            kind, value = given[0]
            make = {"json": GrammarSpec.json_schema, "regex": GrammarSpec.regex, "choice": GrammarSpec.choice,
                    "grammar": GrammarSpec.grammar}.get(kind)
            yield "structured_outputs", _spec("structured_outputs", make, value) if make \
                else _spec("structured_outputs", GrammarSpec.json_object)
        for name, make in (("guided_json", GrammarSpec.json_schema), ("guided_regex", GrammarSpec.regex),
                           ("guided_choice", GrammarSpec.choice), ("guided_grammar", GrammarSpec.grammar)):
            value = getattr(self, name)
            if value is not None:
                yield name, _spec(name, make, value)

    @property
    def grammar_field(self) -> str | None:
        """The request field that set the grammar (for error messages), or None."""
        return self._grammar[0] if self._grammar else None

    @field_validator(*_ANY_UNSUPPORTED)
    @classmethod
    def _not_implemented(cls, value, info):
        allowed = cls.unsupported.get(info.field_name)
        if allowed is not None and value not in allowed:
            shown = " or ".join(json.dumps(a) for a in allowed)
            raise ValueError(f"not supported by this server (accepted only as {shown})")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        """Raises:
            ValueError: a key that is not a token id (a non-negative integer) or a bias outside
                [-100, 100] (OpenAI's range).
        """
        for key, value in (bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"bias for token {key} is {value}; biases must lie in [-100, 100]")
        return bias

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop", mode="before", json_schema_input_type=str | list[str] | None)
    @classmethod
    def _stop_list(cls, stop):
        """A single stop string is a list of one.

        Raises:
            ValueError: ``stop`` is neither null, a string nor a list.
        """
        if isinstance(stop, str):
            return [stop]
        if stop is not None and not isinstance(stop, list):
            raise ValueError("must be a string or a list of strings")
        return stop

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: list[str] | None) -> list[str] | None:
        """Raises:
            ValueError: more than ``MAX_STOP_STRINGS`` stop strings, an empty one (it would stop at the
                first character) or one longer than ``MAX_STOP_CHARS``.
        """
        if stop is None:
            return None
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}")
        for i, text in enumerate(stop):
            if not text:
                raise ValueError(f"stop string {i} is empty")
            if len(text) > MAX_STOP_CHARS:
                raise ValueError(f"stop string {i} has {len(text)} characters; at most {MAX_STOP_CHARS} are supported")
        return stop

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info) -> StreamOptions | None:
        """Raises:
            ValueError: ``stream_options`` without ``stream: true`` (as OpenAI answers).
        """
        if options is not None and info.data.get("stream") is not True:
            raise ValueError("only allowed when stream is true")
        return options

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def requested_mode(self) -> str | None:
        return self.rdserve.mode if self.rdserve else None

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per output token, or None when logprobs are off."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def sampling_params(self) -> SamplingParams:
        """Everything but ``max_tokens``, which needs the prompt length (``resolve_max_tokens``).
        Token ids in ``logit_bias`` and ``stop_token_ids`` are checked against the model's
        vocabulary by the replica (:func:`check_token_ids`)."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop=tuple(self.stop or ()), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            logit_bias=tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=self.frequency_penalty or 0.0, presence_penalty=self.presence_penalty or 0.0,
            min_tokens=self.min_tokens or 0, logprobs=self.num_logprobs, prompt_logprobs=self.num_prompt_logprobs,
            grammar=self._grammar[1] if self._grammar else None,
            cache_salt=self.cache_salt or (self.rdserve.cache_salt if self.rdserve else None))


def _field_error(field: str, message: str) -> ValidationError:
    """A validation error on ``field`` (the ingress's 400 names it)."""
    return ValidationError.from_exception_data("request", [{
        "type": PydanticCustomError(field, message), "loc": (field,), "input": None}])


def _spec(field: str, make, *args) -> GrammarSpec:
    """``make(*args)``, a ``GrammarError`` reported on ``field``."""
    try:
        return make(*args)
    except GrammarError as err:
        raise _field_error(field, str(err)) from None


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raises:
        RequestError: a ``logit_bias`` or ``stop_token_ids`` token id outside the model's vocabulary
            of ``vocab_size`` ids, or ``min_tokens`` above ``max_tokens`` (vLLM's checks).
    """
    for token, _ in params.logit_bias:
        if token >= vocab_size:
            raise RequestError("logit_bias", f"logit_bias: token id {token} is out of the vocabulary (0-{vocab_size - 1})")
    for token in params.stop_token_ids:
        if token >= vocab_size:
            raise RequestError("stop_token_ids", f"stop_token_ids: token id {token} is out of the vocabulary "
                                                 f"(0-{vocab_size - 1})")
    if params.min_tokens > params.max_tokens:
        raise RequestError("min_tokens", f"min_tokens: {params.min_tokens} is more than max_tokens ({params.max_tokens})")


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    """A tool call's function: ``arguments`` is JSON text (OpenAI's form)."""

    model_config = ConfigDict(strict=True)
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """``content``: a string or a list of text parts; a string is kept as one text part. An
    assistant message may carry ``tool_calls`` (then ``content`` may be null); a ``tool`` message is
    a call's result, naming it by ``tool_call_id``."""

    model_config = ConfigDict(strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: list[TextPart] | None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content", mode="before", json_schema_input_type=str | list[TextPart] | None)
    @classmethod
    def _text_or_parts(cls, content, info):
        """A string is one text part; null only for an assistant message (with ``tool_calls``).

        Raises:
            ValueError: ``content`` is neither a string nor a list, or a string that is not valid Unicode.
        """
        if isinstance(content, str):
            return [{"type": "text", "text": _valid_unicode(content)}]
        if content is None and info.data.get("role") == "assistant":
            return None
        if not isinstance(content, list):
            raise ValueError("must be a string or a list of text parts")
        return content

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        """Raises:
            ValidationError: an assistant message with neither content nor tool calls, a tool message
                without ``tool_call_id``, or ``tool_calls`` on another role.
        """
        if self.content is None and not self.tool_calls:
            raise _field_error("content", "an assistant message needs content or tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise _field_error("tool_call_id", "a tool message needs the tool_call_id of the call it answers")
        if self.tool_calls and self.role != "assistant":
            raise _field_error("tool_calls", "only assistant messages carry tool_calls")
        return self

    def as_template_input(self) -> dict:
        """``{"role", "content"}`` with text parts joined, as chat templates expect, plus
        ``tool_calls`` / ``tool_call_id`` / ``name`` where set (:mod:`workers.models.tool_prompt`)."""
        text = "".join(p.text for p in self.content or [])
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


class FunctionDefinition(BaseModel):
    """A function tool: ``parameters`` is its arguments' JSON schema (an object schema)."""

    model_config = ConfigDict(strict=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` as OpenAI defines them
    (:mod:`cluster.ingress.tools`): with ``tool_choice`` other than ``none`` the tools are in the
    prompt and a grammar constrains tool calls (``auto``: only inside ``<tool_call>`` blocks;
    ``required`` / a named function: the reply is tool calls)."""

    unsupported: ClassVar[dict[str, tuple]] = CHAT_UNSUPPORTED
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatCompletionRequest:
        """Builds the tool-call grammar (it joins the request's grammar: ``grammar_field`` "tools").

        Raises:
            ValidationError: ``tool_choice`` required or named without ``tools``, a named function
                not among them, duplicate tool names, or tools with another structured-output field.
        """
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise _field_error("tools", "tool names must be unique")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise _field_error("tool_choice", "needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _field_error("tool_choice", f"function {choice.function.name!r} is not among the tools "
                                              f"({', '.join(names)})")
        if self.uses_tools:
            if self.ignore_eos:
                raise _field_error("ignore_eos", "cannot be combined with tools: a reply with tool calls ends where "
                                                 "its grammar does")
            if self._grammar is not None:
                raise _field_error("tools", f"tools cannot be combined with {self._grammar[0]}; "
                                            "use tool_choice none for a structured answer")
            self._grammar = ("tools", tool_grammar([t.model_dump() for t in self.tools], self.effective_tool_choice,
                                                   self.parallel_tool_calls is not False))
        return self

    @property
    def effective_tool_choice(self) -> str | dict:
        """``none``, ``auto``, ``required`` or ``{"type": "function", "function": {"name"}}``; OpenAI's
        default is ``auto`` with tools, ``none`` without."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice

    @property
    def uses_tools(self) -> bool:
        """Tools are in the prompt and their calls are parsed (``tool_choice`` other than ``none``)."""
        return bool(self.tools) and self.effective_tool_choice != "none"

    @property
    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.uses_tools else None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        """Raises:
            PydanticCustomError: ``top_logprobs`` without ``logprobs: true`` (as OpenAI answers),
                reported on ``top_logprobs``.
        """
        if self.top_logprobs is not None and self.logprobs is not True:
            raise _field_error("top_logprobs", "only allowed when logprobs is true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_GenerationRequest):
    """``prompt``: a string, or a list of one string (kept as that string)."""

    unsupported: ClassVar[dict[str, tuple]] = COMPLETION_UNSUPPORTED
    prompt: Text
    max_tokens: int | None = Field(COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Echo with logprobs returns the prompt's too (as many alternatives as the output's)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @field_validator("max_tokens")
    @classmethod
    def _null_means_default(cls, value: int | None) -> int:
        """An explicit ``null`` is OpenAI's default (16), as when the field is absent."""
        return COMPLETIONS_DEFAULT_MAX_TOKENS if value is None else value

    @field_validator("prompt", mode="before", json_schema_input_type=str | list[str])
    @classmethod
    def _single_prompt(cls, prompt):
        """A list of one prompt is that prompt.

        Raises:
            ValueError: token ids (OpenAI's integer-array prompt forms), a list of other than one prompt,
                or neither a string nor a list.
        """
        if isinstance(prompt, list):
            if any(isinstance(p, (int, list)) and not isinstance(p, bool) for p in prompt):
                raise ValueError("token-id prompts (arrays of integers) are not supported; send the prompt "
                                 "text as a string")
            if len(prompt) != 1:
                raise ValueError("only a single prompt string is supported")
            return prompt[0]
        if not isinstance(prompt, str):
            raise ValueError("must be a string or a list of one string")
        return prompt

    @property
    def prompt_text(self) -> str:
        return self.prompt

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens served from the prefix cache (their prefill skipped)."""

    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class RdserveStats(BaseModel):
    """How the request was decoded; counters as in ``workers.outputs.GenerationDelta``.

    tokens_per_step: mean (accepted draft tokens + 1) per generation step (1.0 for plain decoding).
    replica: the Ray Serve id of the engine replica that served the request.
    """

    mode: Literal["spec", "plain"]
    reason: str
    num_steps: int
    accepted_draft_tokens: int
    tokens_per_step: float
    replica: str | None = None


class TopLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobEntry(TopLogprobEntry):
    top_logprobs: list[TopLogprobEntry]


class ChatLogprobs(BaseModel):
    """OpenAI's chat ``logprobs``: one entry per output token."""

    content: list[ChatLogprobEntry] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions ``logprobs``: parallel lists, one entry per token of the text
    (prompt tokens first with ``echo``, the first of them ``None``); ``text_offset`` is each
    token's start in the choice's text (characters)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry for one token id."""

    logprob: float
    rank: int
    decoded_token: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    rdserve: RdserveStats
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, Any]
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    rdserve: RdserveStats | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    """Both the whole response and a streamed chunk (OpenAI uses ``text_completion`` for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    rdserve: RdserveStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rdserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
