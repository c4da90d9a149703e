"""OpenAI request parsing and response shaping for `service.api`, free of HTTP and Redis.

Parsing turns a JSON body into a `ParsedRequest` (wire sampling fields validated by
`SamplingParams`) or raises `ApiError` naming the parameter. Shaping turns `TokenChunk`s into
OpenAI's `text_completion` / `chat.completion` objects and their streaming chunks.

A field the parser does not know is refused (400 naming it), or with `KVRAIL_UNKNOWN_FIELDS=warn`
logged and ignored: a field that is accepted takes effect. The known fields are the ones the
parser reads (`RequestBody`), so the parser is their only list. A completion's `prompt` may be
a batch: each prompt is its own engine request (`engine_request_ids`), and its choices are
numbered `prompt_index * n + i`, as vLLM does. With vLLM's `use_beam_search`, `n` is the beam
width and each prompt's choices are its beams, best first (`engine.BeamSearchParams`).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Literal

import structlog

from engine import (
    MAX_LOGPROBS,
    BeamSearchParams,
    FinishReason,
    SamplingParams,
    StructuredOutputsParams,
    TokenBytes,
    apply_chat_continuation,
    apply_chat_template,
    sampling_fields,
)
from queueing.schema import SchemaError, TokenChunk, check_id, check_priority
from service.tool_calls import ToolCallParser, ToolChoice, tool_constraint, whole_answer

log = structlog.get_logger("kvrail.api")

Kind = Literal["chat", "completion"]
_MISSING = object()
# Sampling fields each parsed in their own way: max_tokens and logprobs differ between the
# endpoints, structured_outputs has other names besides its own, the others take more than a
# JSON type check.
PARSED_APART = (
    "max_tokens",
    "logprobs",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "structured_outputs",
)
# The other sampling fields, shared by both endpoints, by the JSON types they may have.
_PLAIN_FIELDS = {
    name: spec.kinds for name, spec in sampling_fields().items() if name not in PARSED_APART
}
# vLLM's older names of one constraint each: field -> (StructuredOutputsParams field, types)
GUIDED_FIELDS: dict[str, tuple[str, tuple[type, ...]]] = {
    "guided_json": ("json", (dict, str)),
    "guided_regex": ("regex", (str,)),
    "guided_choice": ("choice", (list,)),
    "guided_grammar": ("grammar", (str,)),
}


# Seconds a client waits before retrying when the server is busy (its backlog, a worker's full
# waiting queue): requests finish within seconds, so a second frees room.
RETRY_AFTER_BUSY_S = 1


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def chunk_error(chunk: TokenChunk) -> ApiError:
    """What a worker's error chunk answers: overload (`retry`) a 429 to retry, as the API's own
    backlog limit answers; a request the engine refused as given (`invalid`) a 400; anything
    else a 500."""
    if chunk.invalid:
        return ApiError(400, chunk.error)
    if chunk.retry:
        return ApiError(
            429,
            chunk.error,
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(RETRY_AFTER_BUSY_S)},
        )
    return ApiError(500, chunk.error, type="server_error", code="worker_error")


class RequestBody(dict):
    """A request's JSON object that notes each field its parser looks up (`get`, `[]`, `in`).

    An endpoint knows the fields its parser reads, so a parser must look up every field it
    knows whatever the others hold; the fields never looked up are `unread`."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def unread(self) -> list[str]:
        return [name for name in self if name not in self.read]


@dataclass(frozen=True)
class ParseContext:
    """What parsing needs to know of the server: the model served, its vocabulary size, the
    variables its chat template reads (`engine.chat_template_variables`), and what to do
    with an unknown field (`Settings.unknown_fields`: "reject" or "warn")."""

    model: str
    vocab_size: int
    template_variables: frozenset[str]
    unknown_fields: str


@dataclass
class ChatTemplate:
    """How a conversation is rendered: vLLM's `add_generation_prompt` (the assistant's turn
    opened), `continue_final_message` (the last message left open, without its end of turn,
    for the model to continue it) and `chat_template_kwargs` (template variables)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None  # OpenAI's function definitions shown

    def apply(
        self, tokenizer: Any, messages: list[dict[str, Any]], add_special_tokens: bool = False
    ) -> list[int]:
        return apply_chat_template(
            tokenizer,
            messages,
            add_generation_prompt=self.add_generation_prompt,
            add_special_tokens=add_special_tokens,
            continue_final_message=self.continue_final_message,
            tools=self.tools,
            **self.kwargs,
        )[1]

    def apply_continuation(
        self, tokenizer: Any, messages: list[dict[str, Any]], history_token_ids: list[int]
    ) -> list[int]:
        """A session's later turn: `messages` after the tokens so far
        (`engine.apply_chat_continuation`)."""
        return apply_chat_continuation(
            tokenizer,
            messages,
            history_token_ids,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            tools=self.tools,
            **self.kwargs,
        )[1]


@dataclass
class ParsedRequest:
    """A validated generation request, before tokenization."""

    kind: Kind
    request_id: str
    sampling: dict[str, Any]  # wire sampling fields (queueing.schema.SAMPLING_FIELDS)
    stream: bool
    include_usage: bool
    # completions: one engine request per prompt, text (tokenized with special tokens) or ids
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, str]] | None = None  # chat: rendered by `chat_template`
    chat_template: ChatTemplate | None = None
    echo: bool = False  # completions: each choice's text (and logprobs) begin with its prompt
    # echo with max_tokens 0: the engine, whose minimum is 1, samples one token that is
    # dropped, as vLLM does; the prompt's logprobs are what such a request is for
    echo_only: bool = False
    tool_choice: ToolChoice | None = None  # chat with tools: how its choices call them
    priority: int = 0  # vLLM's: lower runs first (`GenerateRequest.priority`)
    # chat: the streaming-input session this request is the next turn of (its id is the
    # request's, and its engine request's)
    session_id: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # use_beam_search: the wire map of `BeamSearchParams` (then `sampling` is empty)
    beam_search: dict[str, Any] | None = None

    @property
    def engine_request_ids(self) -> list[str]:
        return engine_request_ids(self.request_id, max(1, len(self.prompts)))

    @property
    def n(self) -> int:
        """Choices per prompt: `n`, a beam search's width."""
        if self.beam_search is not None:
            return self.beam_search["beam_width"]
        return self.sampling.get("n", 1)

    @property
    def max_tokens(self) -> int | None:
        return (self.beam_search or self.sampling)["max_tokens"]


def engine_request_ids(request_id: str, num_prompts: int) -> list[str]:
    """The engine requests of an HTTP request: its own id for one prompt, else one per prompt."""
    if num_prompts == 1:
        return [request_id]
    return [f"{request_id}-{p}" for p in range(num_prompts)]


# ---- parsing -----------------------------------------------------------------------------------


def _describe(kinds: tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names |= {list: "an array", dict: "an object"}
    return " or ".join(dict.fromkeys(names[k] for k in kinds))


def get_field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    """`body[name]` checked against JSON types (null = absent); raises ApiError naming it."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    # JSON true/false must not pass as the integers Python considers them.
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be {_describe(kinds)}", param=name)
    return value


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise ApiError(400, f"'{name}' must be an array of non-negative integers", param=name)
    return value


def check_model(body: dict[str, Any], served_model: str, required: bool = True) -> None:
    """404 unless `body.model` names the served model (400 when required and absent)."""
    model = get_field(body, "model", (str,))
    if model is None:
        if required:
            raise ApiError(400, "'model' is required", param="model")
        return
    if model != served_model:
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this server serves '{served_model}'",
            param="model",
            code="model_not_found",
        )


def _unknown(names: list[str], policy: str, where: str = "") -> None:
    """Refuse the unknown `names` (400 naming the first), or with policy "warn" log them."""
    if not names:
        return
    params = [where + name for name in names]
    if policy == "warn":
        log.warning("unknown request fields ignored", fields=params)
        return
    listed = ", ".join(f"'{p}'" for p in params)
    raise ApiError(400, f"Unknown parameter: {listed}.", param=params[0], code="unknown_parameter")


def _parse_sampling(
    body: dict[str, Any],
    max_tokens: int | None,
    context: ParseContext,
    tool_call_constraint: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The wire sampling fields of a body; `tool_call_constraint`: what its `tool_choice`
    constrains the text to (`service.tool_calls.tool_constraint`)."""
    vocab_size, unknown_fields = context.vocab_size, context.unknown_fields
    sampling: dict[str, Any] = {"max_tokens": max_tokens}
    for name, kinds in _PLAIN_FIELDS.items():
        sampling[name] = get_field(body, name, kinds)
    stop = get_field(body, "stop", (str, list))
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or an array of strings", param="stop")
    sampling["stop"] = stop
    if "stop_token_ids" in body and body["stop_token_ids"] is not None:
        sampling["stop_token_ids"] = _check_vocab(
            _int_list(body["stop_token_ids"], "stop_token_ids"), vocab_size, "stop_token_ids"
        )
    sampling["logit_bias"] = _parse_logit_bias(body, vocab_size)
    source, sampling["structured_outputs"] = _parse_constraint(
        body, unknown_fields, tool_call_constraint
    )
    sampling = {k: v for k, v in sampling.items() if v is not None or k == "max_tokens"}
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        param = str(e).split()[0]
        if param != "structured_outputs" or source == param:
            raise ApiError(400, str(e), param=param) from None
        # xgrammar's verdict on a schema, regex or grammar, of the field that gave it
        raise ApiError(400, f"'{source}' is invalid: {e}", param=source) from None
    return sampling


def _parse_constraint(
    body: dict[str, Any], unknown_fields: str, tool_call_constraint: dict[str, Any] | None
) -> tuple[str | None, Any]:
    """A body's structured-output constraint, as the wire map of `StructuredOutputsParams`
    fields, and the field that gave it: `tool_choice` (required or named), vLLM's
    `structured_outputs`, OpenAI's `response_format` or one of vLLM's older `guided_*`; two
    of them are refused."""
    given: dict[str, dict[str, Any]] = {}
    if tool_call_constraint is not None:
        given["tool_choice"] = tool_call_constraint
    constraint = get_field(body, "structured_outputs", (dict,))
    if constraint is not None:
        given["structured_outputs"] = constraint
    constraint = _parse_response_format(body, unknown_fields)
    if constraint is not None:
        given["response_format"] = constraint
    for name, (kind, kinds) in GUIDED_FIELDS.items():
        value = get_field(body, name, kinds)
        if value is not None:
            given[name] = {kind: value}
    if len(given) > 1:
        first, second = list(given)[:2]
        raise ApiError(400, f"'{second}' cannot be combined with '{first}'", param=second)
    return next(iter(given.items()), (None, None))


def _parse_response_format(body: dict[str, Any], unknown_fields: str) -> dict[str, Any] | None:
    """OpenAI's `response_format`: `text` (no constraint), `json_object` (any JSON object) or
    `json_schema` ({name, schema, strict, description}; without a schema, any JSON object).
    xgrammar keeps to the schema whatever `strict` says, so strict=false is no looser."""
    response_format = get_field(body, "response_format", (dict,))
    if response_format is None:
        return None
    response_format = RequestBody(response_format)
    kind = get_field(response_format, "type", (str,))
    if kind not in ("text", "json_object", "json_schema"):
        raise ApiError(
            400,
            "'response_format.type' must be one of 'text', 'json_object', 'json_schema'",
            param="response_format",
        )
    constraint: dict[str, Any] | None = None
    if kind == "json_object":
        constraint = {"json_object": True}
    elif kind == "json_schema":
        spec = RequestBody(get_field(response_format, "json_schema", (dict,), {}))
        name = get_field(spec, "name", (str,))
        if name is None:
            raise ApiError(
                400, "'response_format.json_schema.name' is required", param="response_format"
            )
        get_field(spec, "strict", (bool,))
        get_field(spec, "description", (str,))
        schema = get_field(spec, "schema", (dict,))
        constraint = {"json_object": True} if schema is None else {"json": schema}
        _unknown(spec.unread(), unknown_fields, "response_format.json_schema.")
    _unknown(response_format.unread(), unknown_fields, "response_format.")
    return constraint


def _parse_logit_bias(body: dict[str, Any], vocab_size: int) -> dict[str, float] | None:
    bias = get_field(body, "logit_bias", (dict,))
    if bias is None:
        return None
    for key, value in bias.items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise ApiError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias")
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ApiError(400, "logit_bias values must be numbers", param="logit_bias")
    return bias  # string keys: msgpack on the wire only takes string map keys


def _check_vocab(token_ids: list[int], vocab_size: int, param: str) -> list[int]:
    if any(t >= vocab_size for t in token_ids):
        raise ApiError(400, f"'{param}' holds a token id >= vocab size {vocab_size}", param=param)
    return token_ids


def _parse_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = get_field(body, "stream", (bool,), False)
    options = get_field(body, "stream_options", (dict,))
    if options is not None and not stream:
        raise ApiError(
            400, "'stream_options' is only allowed with stream=true", param="stream_options"
        )
    include_usage = get_field(options or {}, "include_usage", (bool,), False)
    return stream, include_usage


def _check_prompt_logprobs_stream(sampling: dict[str, Any], stream: bool) -> None:
    """vLLM's rule: prompt logprobs are never streamed, so top-N > 0 with stream=true is
    refused; 0 is accepted and, as nothing would show them, not computed."""
    num_logprobs = sampling.get("prompt_logprobs")
    if num_logprobs is None or not stream:
        return
    if num_logprobs > 0:
        raise ApiError(
            400, "'prompt_logprobs' is not available with stream=true", param="prompt_logprobs"
        )
    del sampling["prompt_logprobs"]


def _parse_priority(body: dict[str, Any]) -> int:
    """vLLM's `priority`: an integer, lower first; a worker whose engine schedules fcfs
    refuses any but 0 (the request's error)."""
    priority = get_field(body, "priority", (int,), 0)
    try:
        check_priority(priority)
    except SchemaError as e:
        raise ApiError(400, str(e), param="priority") from None
    return priority


# The sampling fields a beam search takes: `n` is its width; temperature 0 is what it scores
# at (the model's logprobs as they are), the other fields are refused unless at their defaults.
_BEAM_SEARCH_SAMPLING = ("n", "max_tokens", "ignore_eos")


def _parse_beam_search(body: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's `use_beam_search` (`n` beams, `length_penalty`): the wire map of
    `BeamSearchParams`, or None without it. A sampling field a beam search cannot apply is
    refused, naming it."""
    use_beam_search = get_field(body, "use_beam_search", (bool,), False)
    length_penalty = get_field(body, "length_penalty", (int, float))
    if not use_beam_search:
        if length_penalty is not None:
            raise ApiError(
                400, "'length_penalty' needs use_beam_search=true", param="length_penalty"
            )
        return None
    defaults = SamplingParams()
    for name, value in sampling.items():
        at_default = value == (0 if name == "temperature" else getattr(defaults, name))
        if name not in _BEAM_SEARCH_SAMPLING and not at_default:
            if name == "structured_outputs":  # named by the field that gave the constraint
                sources = ("structured_outputs", "response_format", *GUIDED_FIELDS, "tool_choice")
                name = next(f for f in sources if body.get(f) is not None)
            why = "must be 0 or absent" if name == "temperature" else "does not apply"
            raise ApiError(400, f"'{name}' {why} with use_beam_search=true", param=name)
    beam_search = {
        "beam_width": sampling.get("n", 1),
        "max_tokens": sampling["max_tokens"],
        "ignore_eos": sampling.get("ignore_eos", False),
        "length_penalty": 1.0 if length_penalty is None else length_penalty,
    }
    try:
        BeamSearchParams(**beam_search)
    except ValueError as e:
        name = str(e).split()[0]
        param = "n" if name == "beam_width" else name
        raise ApiError(400, f"'{param}' (use_beam_search): {e}", param=param) from None
    return beam_search


def _reject_unsupported(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if body.get(name) not in (None, False, [], ""):
            raise ApiError(400, f"'{name}' is not supported yet", param=name)


def parse_completion(body: RequestBody, context: ParseContext) -> ParsedRequest:
    """Validate a /v1/completions body: a prompt (text or token ids) or a batch of them."""
    check_model(body, context.model)
    _reject_unsupported(body, ("suffix",))
    prompts = _parse_prompts(body.get("prompt", _MISSING), context.vocab_size)
    echo = get_field(body, "echo", (bool,), False)
    max_tokens = get_field(body, "max_tokens", (int,), 16)
    echo_only = echo and max_tokens == 0
    sampling = _parse_sampling(body, 1 if echo_only else max_tokens, context)
    best_of = get_field(body, "best_of", (int,))
    if best_of is not None and best_of != sampling.get("n", 1):
        raise ApiError(400, "'best_of' other than n is not supported", param="best_of")
    logprobs = get_field(body, "logprobs", (int,))
    if logprobs is not None:
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"'logprobs' must be in [0, {MAX_LOGPROBS}]", param="logprobs")
        sampling["logprobs"] = logprobs
    stream, include_usage = _parse_stream(body)
    if echo and logprobs is not None:
        # The prompt's logprobs lead the choice's: as vLLM, top-`logprobs` unless asked
        # otherwise, and like any prompt logprobs never streamed.
        if stream:
            raise ApiError(
                400, "'echo' with 'logprobs' is not available with stream=true", param="echo"
            )
        sampling.setdefault("prompt_logprobs", logprobs)
    _check_prompt_logprobs_stream(sampling, stream)
    priority = _parse_priority(body)
    beam_search = _parse_beam_search(body, sampling)
    _unknown(body.unread(), context.unknown_fields)
    return ParsedRequest(
        "completion",
        f"cmpl-{uuid.uuid4().hex}",
        {} if beam_search else sampling,
        stream,
        include_usage,
        prompts,
        echo=echo,
        echo_only=echo_only,
        priority=priority,
        beam_search=beam_search,
    )


def _parse_prompts(value: Any, vocab_size: int) -> list[str | list[int]]:
    """A prompt, or a batch: an array of prompts (strings or token-id arrays)."""
    if value is _MISSING:
        raise ApiError(400, "'prompt' is required", param="prompt")
    is_batch = isinstance(value, list) and value and all(isinstance(p, str | list) for p in value)
    return [_parse_prompt(p, vocab_size) for p in (value if is_batch else [value])]


def _parse_prompt(value: Any, vocab_size: int) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise ApiError(400, "'prompt' must not be empty", param="prompt")
        return value
    if isinstance(value, list) and value:
        return _check_vocab(_int_list(value, "prompt"), vocab_size, "prompt")
    raise ApiError(
        400,
        "'prompt' must be a non-empty string or array of token ids, or an array of those",
        param="prompt",
    )


def parse_chat(body: RequestBody, context: ParseContext) -> ParsedRequest:
    """Validate a /v1/chat/completions body: text messages, tools (`service.tool_calls`)."""
    check_model(body, context.model)
    _reject_unsupported(body, ("audio",))
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise ApiError(400, f"'{name}' is deprecated and not served: use 'tools'", param=name)
    messages = parse_messages(body.get("messages", _MISSING))
    tools, tool_choice, parallel_tool_calls = _parse_tools(body, context.unknown_fields)
    chat_template = parse_chat_template(body, context, tools)
    max_completion_tokens = get_field(body, "max_completion_tokens", (int,))
    max_tokens = get_field(body, "max_tokens", (int,))
    if max_completion_tokens is not None:
        max_tokens = max_completion_tokens
    tool_call_constraint = None
    if tool_choice is not None:
        try:
            tool_call_constraint = tool_constraint(tools, tool_choice, parallel_tool_calls)
        except ValueError as e:
            raise ApiError(400, str(e), param="tools") from None
    sampling = _parse_sampling(body, max_tokens, context, tool_call_constraint)
    want_logprobs = get_field(body, "logprobs", (bool,), False)
    top_logprobs = get_field(body, "top_logprobs", (int,))
    if top_logprobs is not None:
        if not want_logprobs:
            raise ApiError(400, "'top_logprobs' needs logprobs=true", param="top_logprobs")
        if not 0 <= top_logprobs <= MAX_LOGPROBS:
            raise ApiError(
                400, f"'top_logprobs' must be in [0, {MAX_LOGPROBS}]", param="top_logprobs"
            )
    if want_logprobs:
        sampling["logprobs"] = top_logprobs or 0
    stream, include_usage = _parse_stream(body)
    _check_prompt_logprobs_stream(sampling, stream)
    priority = _parse_priority(body)
    beam_search = _parse_beam_search(body, sampling)
    session_id = _parse_session_id(body, sampling)
    if beam_search and session_id:
        raise ApiError(
            400,
            "'session_id': a session's turn samples, it cannot be a beam search",
            param="use_beam_search",
        )
    _unknown(body.unread(), context.unknown_fields)
    return ParsedRequest(
        "chat",
        session_id or f"chatcmpl-{uuid.uuid4().hex}",
        {} if beam_search else sampling,
        stream,
        include_usage,
        messages=messages,
        chat_template=chat_template,
        tool_choice=tool_choice,
        priority=priority,
        beam_search=beam_search,
        session_id=session_id,
    )


def _parse_session_id(body: dict[str, Any], sampling: dict[str, Any]) -> str | None:
    """kvrail's `session_id` (sent as extra body): this request is the next turn of that
    streaming-input session, its messages the new ones only; one choice."""
    session_id = get_field(body, "session_id", (str,))
    if session_id is None:
        return None
    try:
        check_id(session_id, "'session_id'")
    except SchemaError as e:
        raise ApiError(400, str(e), param="session_id") from None
    if sampling.get("n", 1) != 1:
        raise ApiError(400, "'session_id' takes n=1: a session continues one sequence", param="n")
    return session_id


_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _parse_tools(
    body: dict[str, Any], unknown_fields: str
) -> tuple[list[dict[str, Any]] | None, ToolChoice | None, bool]:
    """OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`: the tools the prompt shows
    (None: none), how the choices call them (None: they do not), and whether one choice may
    call several. `tool_choice` defaults to "auto" with tools, as OpenAI's does; "none" leaves
    the tools out of the prompt, so the model is not told of functions it may not call."""
    tools = get_field(body, "tools", (list,)) or None
    choice = get_field(body, "tool_choice", (str, dict))
    parallel_tool_calls = get_field(body, "parallel_tool_calls", (bool,), True)
    if tools is None:
        if choice not in (None, "none"):
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        return None, None, parallel_tool_calls
    names = [_parse_tool(tool, i, unknown_fields) for i, tool in enumerate(tools)]
    if len(set(names)) < len(names):
        raise ApiError(400, "'tools' must have distinct function names", param="tools")
    if choice is None or choice == "auto":
        return tools, ToolChoice("auto"), parallel_tool_calls
    if choice == "none":
        return None, None, parallel_tool_calls
    if choice == "required":
        return tools, ToolChoice("required"), parallel_tool_calls
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name is None:
        raise ApiError(
            400,
            "'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in names:
        raise ApiError(
            400, f"'tool_choice' names {name!r}, not one of 'tools'", param="tool_choice"
        )
    return tools, ToolChoice("named", name), parallel_tool_calls


def _parse_tool(tool: Any, i: int, unknown_fields: str) -> str:
    """Check `tools[i]` ({"type": "function", "function": {name, description, parameters,
    strict}}); its function's name."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ApiError(400, f'\'{where}\' must be {{"type": "function", ...}}', param="tools")
    tool = RequestBody(tool)
    get_field(tool, "type", (str,))
    function = RequestBody(get_field(tool, "function", (dict,), {}))
    name = get_field(function, "name", (str,))
    if name is None or not _FUNCTION_NAME.match(name):
        raise ApiError(
            400, f"'{where}.function.name' must be 1-64 of a-z, A-Z, 0-9, _ and -", param="tools"
        )
    get_field(function, "description", (str,))
    get_field(function, "strict", (bool,))
    parameters = get_field(function, "parameters", (dict,))
    if parameters is not None:
        try:
            StructuredOutputsParams(json=parameters)
        except ValueError as e:
            message = str(e).removeprefix("structured_outputs json is invalid: ")
            raise ApiError(
                400,
                f"'{where}.function.parameters' is not a valid JSON schema: {message}",
                param="tools",
            ) from None
    _unknown(function.unread(), unknown_fields, f"{where}.function.")
    _unknown(tool.unread(), unknown_fields, f"{where}.")
    return name


def parse_chat_template(
    body: dict[str, Any], context: ParseContext, tools: list[dict[str, Any]] | None = None
) -> ChatTemplate:
    """The chat template options of a body (chat completions, /tokenize with messages).
    `add_generation_prompt` defaults to true, or to false with `continue_final_message`; both
    true is refused, as vLLM does. A `chat_template_kwargs` key the template does not read
    is an unknown field (`ParseContext.unknown_fields`)."""
    continue_final = get_field(body, "continue_final_message", (bool,), False)
    add_generation_prompt = get_field(body, "add_generation_prompt", (bool,), not continue_final)
    if continue_final and add_generation_prompt:
        raise ApiError(
            400,
            "'continue_final_message' cannot be combined with add_generation_prompt=true",
            param="continue_final_message",
        )
    kwargs = get_field(body, "chat_template_kwargs", (dict,), {})
    variables = context.template_variables
    _unknown(
        [k for k in kwargs if k not in variables], context.unknown_fields, "chat_template_kwargs."
    )
    kwargs = {k: v for k, v in kwargs.items() if k in variables}
    return ChatTemplate(add_generation_prompt, continue_final, kwargs, tools)


ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """Chat messages as the chat template takes them: {role, content} with text content
    (parts joined by newlines, as vLLM joins them), OpenAI's `developer` role as `system`
    (what templates know), an assistant's `tool_calls` with their arguments as objects, and
    a tool message's `tool_call_id`."""
    if value is _MISSING:
        raise ApiError(400, "'messages' is required", param="messages")
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty array", param="messages")
    messages = []
    for message in value:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ApiError(
                400, f"each message needs a 'role', one of {', '.join(ROLES)}", param="messages"
            )
        role = "system" if message["role"] == "developer" else message["role"]
        parsed: dict[str, Any] = {"role": role, "content": _message_text(message)}
        if role == "assistant" and message.get("tool_calls"):
            parsed["tool_calls"] = _message_tool_calls(message["tool_calls"])
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise ApiError(
                    400, "a tool message needs a string 'tool_call_id'", param="messages"
                )
            parsed["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            parsed["name"] = message["name"]
        messages.append(parsed)
    return messages


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "\n".join(p["text"] for p in content)
    raise ApiError(
        400, "message content must be a string or an array of text parts", param="messages"
    )


def _message_tool_calls(calls: Any) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, each function's JSON `arguments` as the object
    chat templates take."""
    why = "an assistant's 'tool_calls' must be an array of {id, type: 'function', function: "
    why += "{name, arguments}} with arguments a JSON object"
    if not isinstance(calls, list):
        raise ApiError(400, why, param="messages")
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        try:
            arguments = json.loads(function["arguments"])
            ok = isinstance(function["name"], str) and isinstance(arguments, dict)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok or call.get("type", "function") != "function":
            raise ApiError(400, why, param="messages")
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        parsed.append(entry)
    return parsed


# ---- shaping -----------------------------------------------------------------------------------


class TokenStrings:
    """Token id -> its text, as OpenAI's logprobs show tokens (cached per id); `bytes`: its
    bytes in the vocabulary (`engine.TokenBytes`), whole even where the text is U+FFFD."""

    def __init__(self, tokenizer: Any) -> None:
        self._text = lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id]))
        self.bytes = TokenBytes(tokenizer)

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)


@dataclass
class Prompt:
    """One prompt as its engine request has it, and the text `echo` repeats (None without)."""

    token_ids: list[int]
    echo: str | None = None


def _finite(logprob: float) -> float:
    """-inf is not JSON: vLLM clamps it to -9999.0, as OpenAI does."""
    return max(float(logprob), -9999.0)


def chat_logprobs(
    chunk: TokenChunk, token_str: TokenStrings, top_logprobs: int
) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` entries for the tokens of one chunk: each sampled token
    with the `top_logprobs` most likely ones at its position."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token_id = int(token_id)
        return {
            "token": token_str(token_id),
            "logprob": _finite(logprob),
            "bytes": list(token_str.bytes(token_id)),
        }

    content = []
    for per_token in chunk.logprobs or []:
        (sampled_id, sampled_lp), *others = per_token
        # The engine's entries are the sampled token, then the top ones without it: k + 1
        # of them when it is not among the top k, k when it is (then it is one of them).
        top = others if len(per_token) > top_logprobs else sorted(per_token, key=lambda e: -e[1])
        item = entry(sampled_id, sampled_lp)
        item["top_logprobs"] = [entry(t, lp) for t, lp in top]
        content.append(item)
    return content


def _legacy_logprobs() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def completion_logprobs(
    chunk: TokenChunk, token_str: TokenStrings, text_offset: int
) -> dict[str, list[Any]]:
    """OpenAI's legacy logprobs object for the tokens of one chunk, offsets from `text_offset`."""
    result = _legacy_logprobs()
    for per_token in chunk.logprobs or []:
        sampled_id, sampled_lp = per_token[0]
        text = token_str(int(sampled_id))
        result["tokens"].append(text)
        result["token_logprobs"].append(_finite(sampled_lp))
        result["top_logprobs"].append({token_str(int(t)): _finite(lp) for t, lp in per_token})
        result["text_offset"].append(text_offset)
        text_offset += len(text)
    return result


def echo_logprobs(
    prompt: Prompt, wire: list[list[list[int | float]] | None] | None, token_str: TokenStrings
) -> dict[str, list[Any]]:
    """The legacy logprobs of an echoed prompt's tokens, from its wire prompt logprobs: null
    at position 0 (nothing comes before it), then the prompt's token and the top ones; all
    null when the request was aborted before its prompt was computed (`wire` None)."""
    result, offset = _legacy_logprobs(), 0
    positions = wire if wire is not None else [None] * len(prompt.token_ids)
    for token_id, position in zip(prompt.token_ids, positions, strict=True):
        text = token_str(token_id)
        result["tokens"].append(text)
        result["token_logprobs"].append(None if position is None else _finite(position[0][1]))
        result["top_logprobs"].append(
            None
            if position is None
            else {token_str(int(t)): _finite(lp) for t, lp, _rank in position}
        )
        result["text_offset"].append(offset)
        offset += len(text)
    return result


def _wire_prompt_logprobs(chunks: list[TokenChunk]) -> list[list[list[int | float]] | None] | None:
    """A request's prompt logprobs, from the chunk that carries them."""
    return next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None)


def prompt_logprobs_json(
    wire: list[list[list[int | float]] | None] | None, token_str: TokenStrings
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt position, null at 0, then {"<token id>": {logprob,
    rank, decoded_token}} with the prompt's token first."""
    if wire is None:
        return None
    return [
        None
        if position is None
        else {
            str(t): {"logprob": _finite(lp), "rank": int(rank), "decoded_token": token_str(int(t))}
            for t, lp, rank in position
        }
        for position in wire
    ]


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: the prompt tokens found in the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def cached_tokens_of(last: TokenChunk) -> int:
    """The prompt tokens the worker found in the prefix cache (0 from one that does not say)."""
    if last.usage and isinstance(last.usage.get("cached_tokens"), int):
        return last.usage["cached_tokens"]
    return 0


def completion_tokens_of(last: TokenChunk, chunks: list[TokenChunk]) -> int:
    """The worker's count when it gave one, else the tokens seen."""
    if last.usage and isinstance(last.usage.get("completion_tokens"), int):
        return last.usage["completion_tokens"]
    return sum(len(c.token_ids) for c in chunks)


def _tool_finish(finish_reason: str | None, num_calls: int) -> str | None:
    """OpenAI's finish reason of a choice that called tools and stopped: "tool_calls"."""
    return "tool_calls" if num_calls and finish_reason == FinishReason.STOP else finish_reason


def _finish(chunk: TokenChunk, echo_only: bool) -> tuple[str | None, int | str | None]:
    """A chunk's finish and stop reasons; echo only, the dropped token cannot have stopped
    anything: max_tokens 0 is reached before it."""
    if echo_only and chunk.finish_reason == FinishReason.STOP:
        return FinishReason.LENGTH, None
    return chunk.finish_reason, chunk.stop_reason


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprob_chunks: list[TokenChunk] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def build_response(
    parsed: ParsedRequest,
    model: str,
    results: list[list[TokenChunk]],
    prompts: list[Prompt],
    token_str: TokenStrings,
) -> dict[str, Any]:
    """The non-streaming response object from all chunks of each prompt's engine request."""
    n = parsed.n
    out, completion_tokens = [], 0
    for p, (prompt, chunks) in enumerate(zip(prompts, results, strict=True)):
        choices = {i: _Choice() for i in range(n)}
        for chunk in chunks:
            choice = choices.setdefault(chunk.index, _Choice())
            if not parsed.echo_only:
                choice.text.append(chunk.text)
                if chunk.logprobs:
                    choice.logprob_chunks.append(chunk)
            if chunk.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = _finish(chunk, parsed.echo_only)
        wire = _wire_prompt_logprobs(chunks)
        for i, choice in sorted(choices.items()):
            shaped = _response_choice(parsed, p * n + i, choice, prompt, wire, token_str)
            # As vLLM: on each choice of a completion, once at the top of a chat completion.
            if "prompt_logprobs" in parsed.sampling and parsed.kind == "completion":
                shaped["prompt_logprobs"] = prompt_logprobs_json(wire, token_str)
            out.append(shaped)
        if not parsed.echo_only:
            completion_tokens += completion_tokens_of(chunks[-1], chunks)
    response = {
        "id": parsed.request_id,
        "object": "chat.completion" if parsed.kind == "chat" else "text_completion",
        "created": parsed.created,
        "model": model,
        "choices": out,
        "usage": make_usage(
            sum(len(p.token_ids) for p in prompts),
            completion_tokens,
            sum(cached_tokens_of(chunks[-1]) for chunks in results),
        ),
    }
    if "prompt_logprobs" in parsed.sampling and parsed.kind == "chat":
        response["prompt_logprobs"] = prompt_logprobs_json(
            _wire_prompt_logprobs(results[0]), token_str
        )
    return response


def _response_choice(
    parsed: ParsedRequest,
    index: int,
    choice: _Choice,
    prompt: Prompt,
    wire: list[list[list[int | float]] | None] | None,
    token_str: TokenStrings,
) -> dict[str, Any]:
    text = "".join(choice.text)
    common = {"index": index, "finish_reason": choice.finish_reason}
    common["stop_reason"] = choice.stop_reason
    top = parsed.sampling.get("logprobs")
    if parsed.kind == "chat":
        logprobs = None
        if top is not None:
            content = [e for c in choice.logprob_chunks for e in chat_logprobs(c, token_str, top)]
            logprobs = {"content": content, "refusal": None}
        message = {"role": "assistant", "content": text, "refusal": None, "tool_calls": []}
        if parsed.tool_choice is not None:
            parser = ToolCallParser(parsed.tool_choice, parsed.request_id, index)
            message["content"], calls = whole_answer(parser, text)
            message["tool_calls"] = [call.to_json() for call in calls]
            common["finish_reason"] = _tool_finish(choice.finish_reason, len(calls))
        return {**common, "message": message, "logprobs": logprobs}
    logprobs, offset = None, 0
    if top is not None:
        logprobs = _legacy_logprobs()
        if prompt.echo is not None:  # the prompt's tokens first, then the generated ones
            logprobs = echo_logprobs(prompt, wire, token_str)
            offset = len(prompt.echo)
        for chunk in choice.logprob_chunks:
            part = completion_logprobs(chunk, token_str, offset)
            for key, values in part.items():
                logprobs[key].extend(values)
            offset += sum(len(t) for t in part["tokens"])
    if prompt.echo is not None:
        text = prompt.echo + text
    return {**common, "text": text, "logprobs": logprobs}


@dataclass
class StreamShape:
    """What a stream's SSE events need besides the chunks; stored in Redis for resumes."""

    kind: Kind
    request_id: str
    model: str
    created: int
    include_usage: bool
    prompt_tokens: int  # of every prompt
    num_prompts: int = 1
    n: int = 1
    top_logprobs: int | None = None  # the sampling's logprobs: None when not asked
    echo: list[str] | None = None  # per prompt, the text its choices begin with
    echo_only: bool = False
    tool_choice: ToolChoice | None = None  # chat with tools: how its choices call them
    # A session's turn: its chunks follow the earlier turns' (the last of which is after_seq)
    turn: int = 0
    after_seq: int = -1

    @property
    def request_ids(self) -> list[str]:
        return engine_request_ids(self.request_id, self.num_prompts)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> StreamShape:
        fields = json.loads(text)
        if fields.get("tool_choice") is not None:
            fields["tool_choice"] = ToolChoice(**fields["tool_choice"])
        return cls(**fields)


def event_id(seqs: list[int]) -> str:
    """An SSE event's id: per prompt, the seq of its last chunk sent (-1: none yet), joined by
    '.'; so for one prompt, the chunk's seq. `Last-Event-ID` gives it back to resume."""
    return ".".join(map(str, seqs))


def parse_event_id(text: str) -> list[int]:
    """The per-prompt seqs of a `Last-Event-ID` (`event_id`); raises ApiError naming it."""
    try:
        seqs = [int(part) for part in text.strip().split(".")]
    except ValueError:
        raise ApiError(
            400, "Last-Event-ID must be an event id (seqs joined by '.')", param="Last-Event-ID"
        ) from None
    if min(seqs) < -1:
        raise ApiError(400, "Last-Event-ID must hold seqs >= -1", param="Last-Event-ID")
    return seqs


def sse(payload: dict[str, Any] | str, event_id: str | None = None, event: str | None = None):
    """One Server-Sent Event; dict payloads are JSON."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    head = f"id: {event_id}\n" if event_id is not None else ""
    head += f"event: {event}\n" if event is not None else ""
    return f"{head}data: {data}\n\n"


class StreamEvents:
    """Turns the chunks of a request's engine requests into OpenAI's streaming events.

    It is given every chunk from the first, as they come from each prompt's engine request,
    and returns events only for those after `after` (per prompt, the last seq the client
    has), so a resumed stream knows what came before: each choice's role delta (chat) comes
    before its first chunk sent, its text offsets continue, and the usage counts every
    chunk. A fresh stream begins with each choice's echoed prompt, if asked.
    """

    def __init__(self, shape: StreamShape, token_str: TokenStrings, after: list[int]) -> None:
        self.shape = shape
        self.token_str = token_str
        self.after = after
        self.sent = list(after)  # per prompt, the seq of the last chunk the client has
        self.started: set[int] = set()  # choices whose first chunk was seen
        self.text_offsets: dict[int, int] = {}
        self.chunks: list[list[TokenChunk]] = [[] for _ in range(shape.num_prompts)]
        self.tool_parsers: dict[int, ToolCallParser] = {}  # per choice, with tools

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.shape.kind == "chat" else "text_completion"
        envelope = {
            "id": self.shape.request_id,
            "object": kind,
            "created": self.shape.created,
            "model": self.shape.model,
            "choices": choices,
        }
        if self.shape.include_usage:
            envelope["usage"] = None
        return envelope

    def start(self) -> list[str]:
        """The events before any chunk: with echo, each choice's prompt, unless the client
        has had them (it has had a chunk since)."""
        if self.shape.echo is None or max(self.after) >= 0:
            return []
        events = []
        for p, text in enumerate(self.shape.echo):
            for i in range(self.shape.n):
                choice = {"index": p * self.shape.n + i, "text": text, "logprobs": None}
                choice |= {"finish_reason": None, "stop_reason": None}
                events.append(sse(self._envelope([choice])))
        return events

    @property
    def unfinished(self) -> list[str]:
        """The engine requests whose last chunk has not come."""
        return [
            request_id
            for request_id, chunks in zip(self.shape.request_ids, self.chunks, strict=True)
            if not (chunks and chunks[-1].is_last)
        ]

    def for_chunk(self, prompt_index: int, chunk: TokenChunk) -> list[str]:
        """The events for one chunk of prompt `prompt_index`'s engine request: none when the
        client has it; a role delta first for a choice's first chunk (chat)."""
        self.chunks[prompt_index].append(chunk)
        index = prompt_index * self.shape.n + chunk.index
        first = index not in self.started
        self.started.add(index)
        offset = self.text_offsets.get(index, 0)
        self.text_offsets[index] = offset + len(chunk.text)
        delta = self._delta(index, chunk)  # before a resume's skip: tool parsers see it all
        if chunk.seq <= self.after[prompt_index]:
            return []
        self.sent[prompt_index] = chunk.seq
        if chunk.error is not None:
            return [sse(chunk_error(chunk).body(), event_id(self.sent), event="error")]
        events = []
        if first and self.shape.kind == "chat":
            role = {"role": "assistant", "content": ""}
            choice = {"index": index, "delta": role, "logprobs": None, "finish_reason": None}
            events.append(sse(self._envelope([choice])))
        events.append(
            sse(self._envelope([self._choice(index, chunk, offset, delta)]), event_id(self.sent))
        )
        if chunk.is_last and self.shape.include_usage and not self.unfinished:
            events.append(sse(self._usage_event()))
        return events

    def _delta(self, index: int, chunk: TokenChunk) -> dict[str, Any]:
        """A chat chunk's delta: its text, or with tools, the content and call deltas the
        choice's parser makes of it."""
        if self.shape.tool_choice is None:
            return {"content": chunk.text} if chunk.text else {}
        parser = self.tool_parsers.get(index)
        if parser is None:
            parser = ToolCallParser(self.shape.tool_choice, self.shape.request_id, index)
            self.tool_parsers[index] = parser
        content, calls = parser.feed(chunk.text)
        if chunk.finish_reason is not None:
            more_content, more_calls = parser.finish()
            content, calls = content + more_content, calls + more_calls
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [call.to_json() for call in calls]
        return delta

    def _choice(
        self, index: int, chunk: TokenChunk, offset: int, delta: dict[str, Any]
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.shape.kind == "chat":
            choice["delta"] = delta
            choice["logprobs"] = None
            if chunk.logprobs:
                content = chat_logprobs(chunk, self.token_str, self.shape.top_logprobs)
                choice["logprobs"] = {"content": content}
        else:
            dropped = self.shape.echo_only  # the one token sampled for max_tokens 0
            choice["text"] = "" if dropped else chunk.text
            choice["logprobs"] = None
            if chunk.logprobs and not dropped:
                choice["logprobs"] = completion_logprobs(chunk, self.token_str, offset)
        choice["finish_reason"], choice["stop_reason"] = _finish(chunk, self.shape.echo_only)
        if index in self.tool_parsers:
            num_calls = self.tool_parsers[index].num_calls
            choice["finish_reason"] = _tool_finish(choice["finish_reason"], num_calls)
        return choice

    def _usage_event(self) -> dict[str, Any]:
        completion_tokens = 0
        if not self.shape.echo_only:
            completion_tokens = sum(completion_tokens_of(c[-1], c) for c in self.chunks)
        cached_tokens = sum(cached_tokens_of(c[-1]) for c in self.chunks)
        usage = make_usage(self.shape.prompt_tokens, completion_tokens, cached_tokens)
        return {**self._envelope([]), "usage": usage}

    @staticmethod
    def error(error: ApiError) -> str:
        return sse(error.body(), event="error")

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
