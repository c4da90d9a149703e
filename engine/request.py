"""Per-request state: `SamplingParams`, `Request`, its `RequestStatus` and `FinishReason`.

`check_prompt_len` is the one prompt-length rule: `LLMEngine` applies it to the prompt before
fanning a request out, the scheduler to each child (prompt plus resumed tokens) it queues.

Scheduling state is plain counters (`num_computed_tokens`, `num_tokens`), so the
scheduler's decisions are arithmetic on them. Only the scheduler changes `status`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.structured_outputs import StructuredOutputsParams

if TYPE_CHECKING:
    from engine.structured_outputs import StructuredOutputGrammar

# Bounds that keep one request from exhausting the engine; the service enforces the same.
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_LOGIT_BIAS = 1024
MAX_ABS_LOGIT_BIAS = 100
# Counts (top_k, max_tokens, min_tokens) beyond any context; larger values (JSON's 1e20) would
# overflow the wire's integers (issue 12: an HTTP 500).
MAX_INT32 = 2**31 - 1


def _bounded(default: object, **bounds: float) -> Any:
    """A scalar field with its range as JSON Schema keywords (`minimum`, `maximum`,
    `exclusiveMinimum`)."""
    return field(default=default, metadata={"bounds": bounds})


@dataclass
class SamplingParams:
    """How to sample one request's completions (vLLM/OpenAI semantics).

    Validated on construction: a bad value raises `ValueError` naming the field. The fields,
    their types and the ranges in their metadata are the one definition the wire schema, the
    OpenAI parser and the OpenAPI document derive theirs from (see `sampling_fields`).
    """

    n: int = _bounded(1, minimum=1, maximum=MAX_N)
    temperature: float = _bounded(1.0, minimum=0)  # 0 = greedy
    top_p: float = _bounded(1.0, exclusiveMinimum=0, maximum=1)
    top_k: int = _bounded(-1, minimum=-1, maximum=MAX_INT32)  # -1, 0 = all tokens
    min_p: float = _bounded(0.0, minimum=0, maximum=1)
    # per-request generator: same seed, same text, whatever the batch. The range torch's
    # generator and msgpack take; choice i of n uses seed + i, wrapped into it.
    seed: int | None = _bounded(None, minimum=-(2**63), maximum=2**64 - 1)
    max_tokens: int | None = _bounded(16, minimum=1, maximum=MAX_INT32)  # None: max_model_len
    # EOS and stop_token_ids are masked until this many tokens exist
    min_tokens: int = _bounded(0, minimum=0, maximum=MAX_INT32)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = _bounded(0.0, minimum=-2, maximum=2)  # on output tokens
    frequency_penalty: float = _bounded(0.0, minimum=-2, maximum=2)  # on output tokens
    # on prompt and output tokens
    repetition_penalty: float = _bounded(1.0, exclusiveMinimum=0, maximum=2)
    # top-N logprobs per sampled token (plus the sampled one)
    logprobs: int | None = _bounded(None, minimum=0, maximum=MAX_LOGPROBS)
    # top-N logprobs per prompt position (plus the prompt's own token); such a request takes
    # no prefix-cache hits, as every prompt position needs its logits
    prompt_logprobs: int | None = _bounded(None, minimum=0, maximum=MAX_LOGPROBS)
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    skip_special_tokens: bool = True
    # The text follows a JSON schema, regex, choice or grammar; the map of its fields is
    # taken too (the wire's form), made into one on construction
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):  # keys or values from the wire, of any type
                raise ValueError("logit_bias must map token ids to numbers") from None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._validate()
        if self.temperature < 1e-5:
            # Greedy: sampling knobs are meaningless, normalise them so batches can skip them.
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, -1, 0.0

    def _validate(self) -> None:
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        for spec in sampling_fields().values():
            value = getattr(self, spec.name)
            if spec.kinds in ((int,), (int, float)):  # the numbers: type and range
                check(spec.admits(value), spec.name, spec.why)
            elif spec.name == "stop":
                check(
                    len(value) <= MAX_STOP_STRINGS
                    and all(
                        isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN for s in value
                    ),
                    "stop",
                    f"must be at most {MAX_STOP_STRINGS} non-empty strings of "
                    f"<= {MAX_STOP_STRING_LEN} chars",
                )
            elif spec.name == "stop_token_ids":
                check(
                    all(_is_int(t) and t >= 0 for t in value),
                    "stop_token_ids",
                    "must be non-negative integers",
                )
            elif spec.name == "logit_bias":
                check(
                    value is None
                    or (
                        len(value) <= MAX_LOGIT_BIAS
                        and all(k >= 0 and abs(v) <= MAX_ABS_LOGIT_BIAS for k, v in value.items())
                    ),
                    "logit_bias",
                    f"must map at most {MAX_LOGIT_BIAS} token ids to biases in "
                    f"[-{MAX_ABS_LOGIT_BIAS}, {MAX_ABS_LOGIT_BIAS}]",
                )
            elif spec.name == "structured_outputs":
                check(
                    value is None or isinstance(value, StructuredOutputsParams),
                    "structured_outputs",
                    "must be a StructuredOutputsParams or the map of its fields",
                )
            if spec.name == "min_tokens":
                check(
                    self.max_tokens is None or self.min_tokens <= self.max_tokens,
                    "min_tokens",
                    "must not exceed max_tokens",
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass(frozen=True)
class SamplingField:
    """One `SamplingParams` field as the service needs it: the Python types a value may have
    (an int passes for a float; None apart), whether None is allowed, and its range."""

    name: str
    kinds: tuple[type, ...]
    nullable: bool
    bounds: dict[str, float]  # JSON Schema keywords: minimum, maximum, exclusiveMinimum
    why: str  # a number's error text when it is out of range or of the wrong type

    def admits(self, value: object) -> bool:
        """`value` has one of the kinds (None when nullable) and lies within the bounds."""
        if value is None:
            return self.nullable
        if not isinstance(value, self.kinds) or (
            isinstance(value, bool) and bool not in self.kinds
        ):
            return False
        if value != value:  # NaN
            return False
        low, high = self.bounds.get("minimum"), self.bounds.get("maximum")
        above = self.bounds.get("exclusiveMinimum")
        return (
            (low is None or value >= low)
            and (high is None or value <= high)
            and (above is None or value > above)
        )


def value_kinds(annotation: Any) -> tuple[tuple[type, ...], bool]:
    """The Python types a value of a dataclass field annotated `annotation` may have, as
    isinstance() takes them, and whether None is allowed: `int | None` -> ((int,), True),
    `float` -> ((int, float), False) (JSON and msgpack write 1.0 as 1), `list[int]` -> list,
    a dataclass -> dict (it travels as the map of its fields)."""
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else ()
    kinds: list[type] = []
    for member in members or (annotation,):
        if member is type(None):
            continue
        origin = typing.get_origin(member) or member
        if dataclasses.is_dataclass(origin):
            kinds.append(dict)
        else:
            kinds += [int, float] if origin is float else [origin]
    return tuple(dict.fromkeys(kinds)), type(None) in members


@functools.cache
def sampling_fields() -> dict[str, SamplingField]:
    """Every `SamplingParams` field by name, in declaration order."""
    hints = typing.get_type_hints(SamplingParams)
    specs = {}
    for f in dataclasses.fields(SamplingParams):
        kinds, nullable = value_kinds(hints[f.name])
        bounds = f.metadata.get("bounds", {})
        specs[f.name] = SamplingField(f.name, kinds, nullable, bounds, _why(kinds, bounds))
    return specs


def _why(kinds: tuple[type, ...], bounds: dict[str, float]) -> str:
    """ "must be an integer in [1, 128]", "must be in (0, 1]", "must be >= 0"..."""
    if not bounds:
        return "must be a number" if float in kinds else "must be an integer"
    what = "an integer " if float not in kinds else ""
    low = bounds.get("minimum", bounds.get("exclusiveMinimum"))
    if "maximum" not in bounds:
        return f"must be {what}>= {low}"
    opening = "[" if "minimum" in bounds else "("
    return f"must be {what}in {opening}{low}, {bounds['maximum']}]"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_prompt_len(num_prompt_tokens: int, max_model_len: int) -> None:
    """A prompt must leave room in the model's context; raises `ValueError` otherwise."""
    if num_prompt_tokens > max_model_len:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens, more than max_model_len {max_model_len}"
        )


class FinishReason(enum.StrEnum):
    """Why a completion ended. A `str`, so it reaches msgpack, JSON and metric labels as its
    value ("stop", "length", "abort"): the wire format is the plain string."""

    STOP = "stop"  # EOS, a stop token id, a stop string, or the end of its grammar
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # waiting, its grammar still compiling (structured outputs)
    # A session's turn has ended: its KV is kept until the next chunk (or it is closed)
    WAITING_FOR_INPUT = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """One sequence being generated: its prompt, what was sampled, how far its KV is computed.

    `num_resumed_tokens`: the prompt's last tokens were emitted as output before a resume
    (`LLMEngine.add_request(resume=...)`); a grammar's matcher accepts them first.
    `priority`: under the "priority" scheduling policy, lower values run first, ties by
    `arrival_order` (the scheduler numbers requests as they arrive).
    `keep_blocks`: once finished (not aborted), the request keeps its KV blocks for the
    requests forked from it (a beam search's next beams, `Scheduler.fork_request`) until
    `Scheduler.release_blocks`.
    `resumable`: a session's turn (`LLMEngine.add_request(resumable=True)`): when it ends, the
    scheduler keeps its KV blocks and it waits for input (`WAITING_FOR_INPUT`); the next turn
    is a new `Request` over the whole history that takes those blocks over.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        num_resumed_tokens: int = 0,
        priority: int = 0,
        keep_blocks: bool = False,
        resumable: bool = False,
    ) -> None:
        self.request_id = request_id
        self.priority = priority
        self.keep_blocks = keep_blocks
        self.resumable = resumable
        self.waiting_since = 0.0  # time.monotonic() when its turn ended (WAITING_FOR_INPUT)
        self.arrival_order = 0  # set by `Scheduler.add_request`
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.num_resumed_tokens = num_resumed_tokens
        self.status = RequestStatus.WAITING
        # Structured outputs: the matcher, from `StructuredOutputManager`; until then the
        # request waits for it
        self.grammar: StructuredOutputGrammar | None = None
        if self.use_structured_output:
            self.status = RequestStatus.WAITING_FOR_FSM
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)  # prompt + output
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling (-1 = not yet)
        self.num_preemptions = 0
        # Chained hashes (`kv_cache.BlockHash`) of the full blocks of all_token_ids.
        self.block_hashes: list[bytes] = []
        # Draft tokens proposed after the last step, verified in the next (speculative decoding).
        self.spec_token_ids: list[int] = []

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)
