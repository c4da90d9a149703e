"""The wire schema: every message kvrail puts on Redis, msgpack-encoded, versioned, never pickled.

Keys (see `keys` below):
    kvrail:requests            stream of GenerateRequest entries, consumer group "engines"
    kvrail:resp:{request_id}   stream of TokenChunk entries for one request (TTL, MAXLEN)
    kvrail:control             stream of Abort entries, read by every worker
    kvrail:dead                dead-letter stream: entries that could not be decoded or served
    kvrail:req:{request_id}    hash: which request-stream entry owns the id, and its state
    kvrail:worker:{name}       heartbeat of one worker (msgpack WorkerInfo, short TTL)
    kvrail:wake:{reader}       an API process's response reader: wakes its blocked XREAD
    kvrail:sse:{request_id}    JSON shape of an SSE response, so /v1/streams/{id} can resume it
    kvrail:reader:{reader}     marker of a response reader: gone after Redis lost its data

Each stream entry has one field, `data`, holding the msgpack map. Decoding is strict: an
unknown version, a missing or mistyped field, an unknown field or an oversize value raises
`SchemaError` with the reason, which the worker puts on the dead-letter stream.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

import msgpack

from engine import MAX_LOGIT_BIAS, BeamSearchParams, sampling_fields, value_kinds

VERSION = 1
MAX_MESSAGE_BYTES = 4 << 20  # a whole encoded message
MAX_PROMPT_CHARS = 1 << 20
MAX_PROMPT_TOKENS = 1 << 17
MAX_MESSAGES = 1024
MAX_ID_LEN = 128
MAX_PRIORITY = 2**31 - 1  # |priority| at most this: room for any order, within the wire's ints
MAX_TURN = 2**31 - 1  # a session's turns are numbered 0.. within the wire's ints
NAMESPACE = "kvrail:"


class keys:  # a namespace of key builders, lower-case like a module
    requests = NAMESPACE + "requests"
    group = "engines"
    control = NAMESPACE + "control"
    dead = NAMESPACE + "dead"

    @staticmethod
    def response(request_id: str) -> str:
        return f"{NAMESPACE}resp:{request_id}"

    @staticmethod
    def request_state(request_id: str) -> str:
        return f"{NAMESPACE}req:{request_id}"

    @staticmethod
    def worker(name: str) -> str:
        return f"{NAMESPACE}worker:{name}"

    @staticmethod
    def wake(reader_id: str) -> str:
        return f"{NAMESPACE}wake:{reader_id}"

    @staticmethod
    def sse(request_id: str) -> str:
        return f"{NAMESPACE}sse:{request_id}"

    @staticmethod
    def reader(reader_id: str) -> str:
        return f"{NAMESPACE}reader:{reader_id}"

    @staticmethod
    def readers(request_id: str) -> str:
        return f"{NAMESPACE}readers:{request_id}"


class SchemaError(ValueError):
    """A message that does not follow the schema; the text says what is wrong."""


def check_prompt_logprobs_size(num_prompt_tokens: int, num_logprobs: int) -> None:
    """Raise SchemaError unless a prompt's logprobs (top-`num_logprobs`) fit in the one chunk
    that carries them. In msgpack a position takes at most 3 bytes of array header, 20 for
    the prompt token's [id, lp, rank] and 16 per top-N one (rank <= 20); 64 KiB stay for the
    rest of the chunk. So 12k prompt tokens with top-20, any prompt with top-0."""
    max_tokens = (MAX_MESSAGE_BYTES - (64 << 10)) // (23 + 16 * num_logprobs)
    if num_prompt_tokens > max_tokens:
        raise SchemaError(
            f"prompt_logprobs {num_logprobs} allows prompts of at most {max_tokens} tokens, "
            f"this one has {num_prompt_tokens}"
        )


def check_priority(priority: int) -> None:
    """Raise SchemaError unless a request's priority is within +-MAX_PRIORITY."""
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise SchemaError(f"priority must be in [{-MAX_PRIORITY}, {MAX_PRIORITY}]")


def _accepted(kinds: tuple[type, ...], nullable: bool) -> tuple[type, ...]:
    return (*kinds, type(None)) if nullable else kinds


# Sampling fields accepted on the wire, with their types (validated again by SamplingParams).
SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    name: _accepted(spec.kinds, spec.nullable) for name, spec in sampling_fields().items()
}
# Beam search fields accepted on the wire (`GenerateRequest.beam_search`), likewise.
BEAM_SEARCH_FIELDS: dict[str, tuple[type, ...]] = {
    name: _accepted(*value_kinds(kind))
    for name, kind in typing.get_type_hints(BeamSearchParams).items()
}


def _check_type(owner: str, name: str, value: Any, types: tuple[type, ...]) -> None:
    # msgpack's true/false must not pass as the integers Python considers them.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise SchemaError(f"{owner} {name!r} has type {type(value).__name__}")


def _check_fields(owner: str, values: dict[str, Any], known: dict[str, tuple[type, ...]]) -> None:
    """Each of a map's fields is known, of one of its types; raise SchemaError naming it."""
    for name, value in values.items():
        types = known.get(name)
        if types is None:
            raise SchemaError(f"unknown {owner} {name!r}")
        _check_type(owner, name, value, types)


@dataclass
class _Message:
    """A wire message: its fields and their types are the dataclass's, its required fields
    those without a default."""

    def encode(self) -> bytes:
        """The msgpack map; a field added later (`_added_later`) only when it is set."""
        values = asdict(self)
        for f in fields(self):
            if f.metadata.get("added_later") and values[f.name] == f.default:
                del values[f.name]
        return msgpack.packb({"v": VERSION, **values}, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> Any:
        """Strictly decode one message; raises SchemaError naming what is wrong."""
        if not isinstance(data, bytes | bytearray):
            raise SchemaError(f"{cls.__name__}: expected bytes, got {type(data).__name__}")
        if len(data) > MAX_MESSAGE_BYTES:
            raise SchemaError(f"{cls.__name__}: message of {len(data)} bytes is too large")
        try:
            obj = unpack_bounded(data)
        except Exception as e:  # msgpack raises several unrelated types
            raise SchemaError(f"{cls.__name__}: not valid msgpack ({e})") from None
        if not isinstance(obj, dict):
            raise SchemaError(f"{cls.__name__}: expected a map, got {type(obj).__name__}")
        if obj.get("v") != VERSION:
            raise SchemaError(f"{cls.__name__}: unsupported version {obj.get('v')!r}")
        obj = {k: v for k, v in obj.items() if k != "v"}
        types = _field_types(cls)
        unknown = sorted(set(obj) - set(types))
        if unknown:
            raise SchemaError(f"{cls.__name__}: unknown field(s) {unknown}")
        for name in _required(cls):
            if name not in obj:
                raise SchemaError(f"{cls.__name__}: missing field {name!r}")
        for name, value in obj.items():
            _check_type(f"{cls.__name__}: field", name, value, types[name])
        message = cls(**obj)
        message.validate()
        return message

    def validate(self) -> None:
        """Checks beyond types; raise SchemaError."""


@functools.cache
def unpack_bounded(data: bytes) -> Any:
    """msgpack-decode `data` (at most MAX_MESSAGE_BYTES: the callers check) with no container
    or string larger than a valid message holds and no binary, so a hostile entry cannot make
    the decoder allocate beyond that (issue 12: an array of 24 MiB of empty maps, decoded,
    took a worker from 492 MB to 2.3 GB)."""
    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=True,
        max_str_len=4 * MAX_PROMPT_CHARS,  # UTF-8 bytes of the longest prompt
        max_array_len=MAX_PROMPT_TOKENS,
        max_map_len=MAX_LOGIT_BIAS,
        max_bin_len=0,
    )


def _field_types(cls: type[_Message]) -> dict[str, tuple[type, ...]]:
    hints = typing.get_type_hints(cls)
    return {f.name: _accepted(*value_kinds(hints[f.name])) for f in fields(cls)}


@functools.cache
def _required(cls: type) -> tuple[str, ...]:
    return tuple(
        f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
    )


def _added_later(default: Any) -> Any:
    """A field added to a message of this version after it shipped: left out of the map while
    at its default, so a process that predates it (a rolling upgrade) still decodes every
    message that does not use it, and refuses, naming the field, one that does."""
    return field(default=default, metadata={"added_later": True})


def check_id(value: str, name: str) -> None:
    if not 0 < len(value) <= MAX_ID_LEN or not value.isprintable() or " " in value:
        raise SchemaError(f"{name} must be 1..{MAX_ID_LEN} printable characters without spaces")


@dataclass
class GenerateRequest(_Message):
    """One request on `kvrail:requests`. Exactly one of prompt, prompt_token_ids, messages."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # chat: the worker applies the chat template
    # SamplingParams fields; structured_outputs as the map of its fields set ({"json": {...}})
    sampling: dict[str, Any] = field(default_factory=dict)
    reply_to: str | None = None  # response stream; None = keys.response(request_id)
    deadline_ms: int | None = None  # unix ms after which the request is finished with an error
    # vLLM's: lower runs first on an engine with scheduling_policy "priority"; others take 0 only
    priority: int = _added_later(0)
    # A beam search instead of sampling (then `sampling` is empty): `BeamSearchParams` fields
    beam_search: dict[str, Any] | None = _added_later(None)  # noqa: RUF009 - a field()
    # A streaming-input session (`LLMEngine.add_request(resumable=True)`): turn 0 opens it,
    # turn k + 1 (same request_id, once turn k has ended) continues it after everything so
    # far; `resumable` false on a turn closes the session when that turn ends
    turn: int = _added_later(0)
    resumable: bool = _added_later(False)

    def validate(self) -> None:
        check_id(self.request_id, "request_id")
        check_priority(self.priority)
        if not 0 <= self.turn <= MAX_TURN:
            raise SchemaError(f"turn must be in [0, {MAX_TURN}]")
        if self.is_session and self.reply_to is not None:
            raise SchemaError("a session's turns answer on its own stream: reply_to must be unset")
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise SchemaError("exactly one of prompt, prompt_token_ids, messages is required")
        if self.prompt is not None and len(self.prompt) > MAX_PROMPT_CHARS:
            raise SchemaError(f"prompt longer than {MAX_PROMPT_CHARS} characters")
        if self.prompt_token_ids is not None and (
            len(self.prompt_token_ids) > MAX_PROMPT_TOKENS
            or not all(type(t) is int and t >= 0 for t in self.prompt_token_ids)
        ):
            raise SchemaError("prompt_token_ids must be non-negative integers")
        if self.messages is not None:
            if not 0 < len(self.messages) <= MAX_MESSAGES:
                raise SchemaError(f"messages must hold 1..{MAX_MESSAGES} entries")
            for m in self.messages:
                if not (
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                ):
                    raise SchemaError("each message needs string 'role' and 'content'")
        _check_fields("sampling field", self.sampling, SAMPLING_FIELDS)
        if self.beam_search is not None:
            if self.sampling:
                raise SchemaError("beam_search cannot be combined with sampling fields")
            if self.is_session:
                raise SchemaError("beam_search cannot be a session's turn (turn, resumable)")
            _check_fields("beam_search field", self.beam_search, BEAM_SEARCH_FIELDS)
            for name in _required(BeamSearchParams):
                if name not in self.beam_search:
                    raise SchemaError(f"beam_search needs {name!r}")
        if self.reply_to is not None and not self.reply_to.startswith(NAMESPACE + "resp:"):
            raise SchemaError(f"reply_to must name a stream under '{NAMESPACE}resp:'")

    @property
    def response_key(self) -> str:
        return self.reply_to or keys.response(self.request_id)

    @property
    def is_session(self) -> bool:
        """A turn of a session: one that opens it, continues it or closes it."""
        return self.resumable or self.turn > 0


@dataclass
class TokenChunk(_Message):
    """One piece of a response on `kvrail:resp:{request_id}`.

    `seq` starts at 0 and grows by one per chunk of the request (across its `n` choices), so a
    reader drops repeats and notices gaps. A choice ends with a chunk carrying `finish_reason`;
    the last chunk of the request carries `usage`. An `error` chunk ends the request.

    A session's turns share one stream and one `seq` sequence; each turn's chunks carry its
    `turn`, its last one its usage, and its first one the turn's own prompt tokens, so the
    stream holds the whole conversation in tokens (`session_history`).
    """

    request_id: str
    seq: int
    index: int = 0  # choice index, 0..n-1
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[list[list[int | float]]] | None = (
        None  # per token: [[id, lp], ...], sampled first
    )
    # Once per request, on choice 0's first chunk, when asked: per prompt position, None at 0,
    # then [[id, lp, rank], ...] with the prompt's token first, then the top-N
    prompt_logprobs: list[list[list[int | float]] | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    # prompt_tokens, completion_tokens, total_tokens, cached_tokens (of the prompt tokens,
    # those found in the prefix cache)
    usage: dict[str, int] | None = None
    error: str | None = None
    # the error is overload (a worker's waiting queue was full): the request may succeed later
    retry: bool = _added_later(False)
    # the error is the request's own: the engine refused it as given (bad input, never retried)
    invalid: bool = _added_later(False)
    turn: int = _added_later(0)  # of a session
    # a session turn's first chunk: the turn's own prompt
    prompt_token_ids: list[int] | None = _added_later(None)  # noqa: RUF009 - a field()

    @property
    def is_last(self) -> bool:
        """The request (a session: its turn) is complete after this chunk."""
        return self.usage is not None or self.error is not None


@dataclass
class SessionHistory:
    """A session as its response stream holds it (`session_history`)."""

    num_turns: int  # turns begun
    ended: bool  # the last of them has ended (its last chunk is stored)
    failed: bool  # a turn ended with an error or an abort: the session is over
    token_ids: list[int]  # prompts and outputs of the ended turns: what the next turn follows
    last_seq: int  # of the last chunk, -1 when none


def session_history(chunks: list[TokenChunk]) -> SessionHistory:
    """What a session's chunks (`kvrail:resp:{id}`, in seq order) say of it, up to a turn
    that failed; raises SchemaError for chunks no session writes (turns out of order, a turn
    whose first chunk lacks its prompt, a choice other than 0)."""
    token_ids: list[int] = []
    turn_ids: list[int] = []
    turn, ended, failed = -1, True, False
    for chunk in chunks:
        if chunk.error is not None or chunk.finish_reason == "abort":
            ended = failed = True
            break
        if chunk.turn != turn:
            if chunk.turn != turn + 1 or not ended or chunk.prompt_token_ids is None:
                raise SchemaError(f"the session's chunks are not in turns at seq {chunk.seq}")
            turn, ended, turn_ids = chunk.turn, False, list(chunk.prompt_token_ids)
        if chunk.index != 0:
            raise SchemaError(f"a session has one choice; chunk {chunk.seq} is of {chunk.index}")
        turn_ids += chunk.token_ids
        if chunk.is_last:
            ended, token_ids = True, token_ids + turn_ids
    return SessionHistory(turn + 1, ended, failed, token_ids, chunks[-1].seq if chunks else -1)


@dataclass
class Abort(_Message):
    """Broadcast on `kvrail:control`: whichever worker holds the request aborts it."""

    request_id: str

    def validate(self) -> None:
        check_id(self.request_id, "request_id")


@dataclass
class WorkerInfo(_Message):
    """A worker's heartbeat, stored at `kvrail:worker:{name}` with a short TTL."""

    name: str
    model: str
    max_model_len: int
    started_ms: int
    heartbeat_ms: int
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
