"""OpenAI request parsing and response shaping for `service.api`, free of HTTP and Redis.

Parsing turns a JSON body into a `ParsedRequest` (wire sampling fields validated by
`SamplingParams`) or raises `ApiError` naming the parameter. Shaping turns `TokenChunk`s into
OpenAI's `text_completion` / `chat.completion` objects and their streaming chunks.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any, Literal

from engine import MAX_LOGPROBS, SamplingParams, sampling_fields
from queueing.schema import TokenChunk

Kind = Literal["chat", "completion"]
_MISSING = object()
# Sampling fields each parsed in their own way: max_tokens and logprobs differ between the
# endpoints, the others take more than a JSON type check.
PARSED_APART = ("max_tokens", "logprobs", "stop", "stop_token_ids", "logit_bias")
# The other sampling fields, shared by both endpoints, by the JSON types they may have.
_PLAIN_FIELDS = {
    name: spec.kinds for name, spec in sampling_fields().items() if name not in PARSED_APART
}


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


@dataclass
class ParsedRequest:
    """A validated generation request, before tokenization."""

    kind: Kind
    request_id: str
    sampling: dict[str, Any]  # wire sampling fields (queueing.schema.SAMPLING_FIELDS)
    stream: bool
    include_usage: bool
    prompt: str | None = None  # completions: text to tokenize with special tokens
    prompt_token_ids: list[int] | None = None  # completions: given as token ids
    messages: list[dict[str, str]] | None = None  # chat: rendered by the chat template
    created: int = field(default_factory=lambda: int(time.time()))


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


def _parse_sampling(body: dict[str, Any], max_tokens: int | None, vocab_size: int) -> dict:
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
    sampling = {k: v for k, v in sampling.items() if v is not None or k == "max_tokens"}
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        raise ApiError(400, str(e), param=str(e).split()[0]) from None
    return sampling


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


def _reject_unsupported(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if body.get(name) not in (None, False, [], ""):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name)


def parse_completion(body: dict[str, Any], served_model: str, vocab_size: int) -> ParsedRequest:
    """Validate a /v1/completions body (one prompt: text or token ids)."""
    check_model(body, served_model)
    _reject_unsupported(body, ("echo", "suffix"))
    prompt, prompt_ids = _parse_prompt(body.get("prompt", _MISSING), vocab_size)
    sampling = _parse_sampling(body, get_field(body, "max_tokens", (int,), 16), vocab_size)
    best_of = get_field(body, "best_of", (int,))
    if best_of is not None and best_of != sampling.get("n", 1):
        raise ApiError(400, "'best_of' other than n is not supported", param="best_of")
    logprobs = get_field(body, "logprobs", (int,))
    if logprobs is not None:
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"'logprobs' must be in [0, {MAX_LOGPROBS}]", param="logprobs")
        sampling["logprobs"] = logprobs
    stream, include_usage = _parse_stream(body)
    _check_prompt_logprobs_stream(sampling, stream)
    return ParsedRequest(
        "completion",
        f"cmpl-{uuid.uuid4().hex}",
        sampling,
        stream,
        include_usage,
        prompt,
        prompt_ids,
    )


def _parse_prompt(value: Any, vocab_size: int) -> tuple[str | None, list[int] | None]:
    # One prompt only: a batch would be several requests behind one response.
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise ApiError(400, "'prompt' must not be empty", param="prompt")
        return value, None
    if isinstance(value, list) and value:
        return None, _check_vocab(_int_list(value, "prompt"), vocab_size, "prompt")
    if value is _MISSING:
        raise ApiError(400, "'prompt' is required", param="prompt")
    raise ApiError(
        400, "'prompt' must be one non-empty string or array of token ids", param="prompt"
    )


def parse_chat(body: dict[str, Any], served_model: str, vocab_size: int) -> ParsedRequest:
    """Validate a /v1/chat/completions body (text messages only, no tools)."""
    check_model(body, served_model)
    _reject_unsupported(body, ("tools", "functions", "audio"))
    response_format = get_field(body, "response_format", (dict,))
    if response_format is not None and response_format.get("type") != "text":
        raise ApiError(
            400, "only response_format type 'text' is supported", param="response_format"
        )
    messages = parse_messages(body.get("messages", _MISSING))
    max_tokens = get_field(body, "max_completion_tokens", (int,))
    if max_tokens is None:
        max_tokens = get_field(body, "max_tokens", (int,))
    sampling = _parse_sampling(body, max_tokens, vocab_size)
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
    return ParsedRequest(
        "chat", f"chatcmpl-{uuid.uuid4().hex}", sampling, stream, include_usage, messages=messages
    )


def parse_messages(value: Any) -> list[dict[str, str]]:
    """Chat messages as {role, content} with text content (parts joined)."""
    if value is _MISSING:
        raise ApiError(400, "'messages' is required", param="messages")
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty array", param="messages")
    messages = []
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "each message needs a string 'role'", param="messages")
        messages.append({"role": message["role"], "content": _message_text(message)})
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
        return "".join(p["text"] for p in content)
    raise ApiError(
        400, "message content must be a string or an array of text parts", param="messages"
    )


# ---- shaping -----------------------------------------------------------------------------------


class TokenStrings:
    """Token id -> its text, as OpenAI's logprobs show tokens (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self._text = lru_cache(maxsize=1 << 16)(lambda token_id: tokenizer.decode([token_id]))

    def __call__(self, token_id: int) -> str:
        return self._text(token_id)


def chat_logprobs(chunk: TokenChunk, token_str: TokenStrings) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` entries for the tokens of one chunk."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_str(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for per_token in chunk.logprobs or []:
        (sampled_id, sampled_lp), *top = per_token
        item = entry(int(sampled_id), float(sampled_lp))
        item["top_logprobs"] = [entry(int(t), float(lp)) for t, lp in top]
        content.append(item)
    return content


def completion_logprobs(
    chunk: TokenChunk, token_str: TokenStrings, text_offset: int
) -> dict[str, list[Any]]:
    """OpenAI's legacy logprobs object for the tokens of one chunk, offsets from `text_offset`."""
    result: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for per_token in chunk.logprobs or []:
        sampled_id, sampled_lp = per_token[0]
        text = token_str(int(sampled_id))
        result["tokens"].append(text)
        result["token_logprobs"].append(float(sampled_lp))
        result["top_logprobs"].append({token_str(int(t)): float(lp) for t, lp in per_token})
        result["text_offset"].append(text_offset)
        text_offset += len(text)
    return result


def prompt_logprobs_json(
    chunks: list[TokenChunk], token_str: TokenStrings
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt position, null at 0, then {"<token id>": {logprob,
    rank, decoded_token}} with the prompt's token first; from the chunk that carries them."""
    wire = next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None)
    if wire is None:
        return None
    return [
        None
        if position is None
        else {
            str(t): {
                # -inf is not JSON: vLLM clamps to -9999.0 as OpenAI does.
                "logprob": max(float(lp), -9999.0),
                "rank": int(rank),
                "decoded_token": token_str(int(t)),
            }
            for t, lp, rank in position
        }
        for position in wire
    ]


def make_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_tokens_of(last: TokenChunk, chunks: list[TokenChunk]) -> int:
    """The worker's count when it gave one, else the tokens seen."""
    if last.usage and isinstance(last.usage.get("completion_tokens"), int):
        return last.usage["completion_tokens"]
    return sum(len(c.token_ids) for c in chunks)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprob_chunks: list[TokenChunk] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def build_response(
    parsed: ParsedRequest,
    model: str,
    chunks: list[TokenChunk],
    prompt_tokens: int,
    token_str: TokenStrings,
) -> dict[str, Any]:
    """The non-streaming response object from all of a request's chunks."""
    choices: dict[int, _Choice] = {i: _Choice() for i in range(parsed.sampling.get("n", 1))}
    for chunk in chunks:
        choice = choices.setdefault(chunk.index, _Choice())
        choice.text.append(chunk.text)
        if chunk.logprobs:
            choice.logprob_chunks.append(chunk)
        if chunk.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = chunk.finish_reason, chunk.stop_reason
    want_logprobs = "logprobs" in parsed.sampling
    out = [
        _response_choice(parsed.kind, index, c, want_logprobs, token_str)
        for index, c in sorted(choices.items())
    ]
    response = {
        "id": parsed.request_id,
        "object": "chat.completion" if parsed.kind == "chat" else "text_completion",
        "created": parsed.created,
        "model": model,
        "choices": out,
        "usage": make_usage(prompt_tokens, completion_tokens_of(chunks[-1], chunks)),
    }
    if "prompt_logprobs" in parsed.sampling:
        # As vLLM: on each choice of a completion, once at the top of a chat completion.
        prompt_logprobs = prompt_logprobs_json(chunks, token_str)
        if parsed.kind == "chat":
            response["prompt_logprobs"] = prompt_logprobs
        else:
            for choice in out:
                choice["prompt_logprobs"] = prompt_logprobs
    return response


def _response_choice(
    kind: Kind, index: int, choice: _Choice, want_logprobs: bool, token_str: TokenStrings
) -> dict[str, Any]:
    text = "".join(choice.text)
    common = {"index": index, "finish_reason": choice.finish_reason}
    common["stop_reason"] = choice.stop_reason
    if kind == "chat":
        logprobs = None
        if want_logprobs:
            content = [e for c in choice.logprob_chunks for e in chat_logprobs(c, token_str)]
            logprobs = {"content": content, "refusal": None}
        message = {"role": "assistant", "content": text, "refusal": None, "tool_calls": []}
        return {**common, "message": message, "logprobs": logprobs}
    logprobs = None
    if want_logprobs:
        logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for chunk in choice.logprob_chunks:
            part = completion_logprobs(chunk, token_str, offset)
            for key, values in part.items():
                logprobs[key].extend(values)
            offset += sum(len(t) for t in part["tokens"])
    return {**common, "text": text, "logprobs": logprobs}


@dataclass
class StreamShape:
    """What a stream's SSE events need besides the chunks; stored in Redis for resumes."""

    kind: Kind
    request_id: str
    model: str
    created: int
    include_usage: bool
    prompt_tokens: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> StreamShape:
        return cls(**json.loads(text))


def sse(payload: dict[str, Any] | str, event_id: int | None = None, event: str | None = None):
    """One Server-Sent Event; dict payloads are JSON."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    head = f"id: {event_id}\n" if event_id is not None else ""
    head += f"event: {event}\n" if event is not None else ""
    return f"{head}data: {data}\n\n"


class StreamEvents:
    """Turns one request's chunks into OpenAI's streaming events, in order."""

    def __init__(self, shape: StreamShape, token_str: TokenStrings, send_roles: bool) -> None:
        self.shape = shape
        self.token_str = token_str
        self.send_roles = send_roles and shape.kind == "chat"
        self.role_sent: set[int] = set()
        self.text_offsets: dict[int, int] = {}
        self.chunks: list[TokenChunk] = []

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

    def for_chunk(self, chunk: TokenChunk) -> list[str]:
        """The events for one chunk: a role delta first for a choice's first chunk (chat)."""
        self.chunks.append(chunk)
        if chunk.error is not None:
            error = ApiError(500, chunk.error, type="server_error", code="worker_error")
            return [sse(error.body(), chunk.seq, event="error")]
        events = []
        if self.send_roles and chunk.index not in self.role_sent:
            self.role_sent.add(chunk.index)
            delta = {"role": "assistant", "content": ""}
            choice = {"index": chunk.index, "delta": delta, "logprobs": None, "finish_reason": None}
            events.append(sse(self._envelope([choice])))
        events.append(sse(self._envelope([self._choice(chunk)]), chunk.seq))
        if chunk.is_last and self.shape.include_usage:
            events.append(sse(self._usage_event(chunk)))
        return events

    def _choice(self, chunk: TokenChunk) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": chunk.index}
        if self.shape.kind == "chat":
            choice["delta"] = {"content": chunk.text} if chunk.text else {}
            lps = {"content": chat_logprobs(chunk, self.token_str)} if chunk.logprobs else None
            choice["logprobs"] = lps
        else:
            choice["text"] = chunk.text
            offset = self.text_offsets.get(chunk.index, 0)
            choice["logprobs"] = (
                completion_logprobs(chunk, self.token_str, offset) if chunk.logprobs else None
            )
            self.text_offsets[chunk.index] = offset + len(chunk.text)
        choice["finish_reason"] = chunk.finish_reason
        choice["stop_reason"] = chunk.stop_reason
        return choice

    def _usage_event(self, last: TokenChunk) -> dict[str, Any]:
        usage = make_usage(self.shape.prompt_tokens, completion_tokens_of(last, self.chunks))
        return {**self._envelope([]), "usage": usage}

    @staticmethod
    def error(error: ApiError) -> str:
        return sse(error.body(), event="error")

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
