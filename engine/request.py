"""Per-request state: `SamplingParams`, `Request`, its `RequestStatus` and `FinishReason`.

`check_prompt_len` is the one prompt-length rule: `LLMEngine` applies it to the prompt before
fanning a request out, the scheduler to each child (prompt plus resumed tokens) it queues.

Scheduling state is plain counters (`num_computed_tokens`, `num_tokens`), so the
scheduler's decisions are arithmetic on them. Only the scheduler changes `status`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# Bounds that keep one request from exhausting the engine; the service enforces the same.
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_LOGIT_BIAS = 1024


@dataclass
class SamplingParams:
    """How to sample one request's completions (vLLM/OpenAI semantics).

    Validated on construction: a bad value raises `ValueError` naming the field.
    """

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = -1  # -1 or 0 = all tokens
    min_p: float = 0.0  # [0, 1]
    seed: int | None = None  # per-request generator: same seed, same text, whatever the batch
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # [-2, 2], on output tokens
    frequency_penalty: float = 0.0  # [-2, 2], on output tokens
    repetition_penalty: float = 1.0  # > 0, on prompt and output tokens
    logprobs: int | None = None  # top-N logprobs per sampled token (plus the sampled one)
    # top-N logprobs per prompt position (plus the prompt's own token); such a request takes
    # no prefix-cache hits, as every prompt position needs its logits
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    skip_special_tokens: bool = True

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
        self._validate()
        if self.temperature < 1e-5:
            # Greedy: sampling knobs are meaningless, normalise them so batches can skip them.
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, -1, 0.0

    def _validate(self) -> None:
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]")
        check(_is_num(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(_is_int(self.top_k) and self.top_k >= -1, "top_k", "must be -1 (disabled) or >= 0")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(self.seed is None or _is_int(self.seed), "seed", "must be an integer")
        check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            "must be an integer >= 1",
        )
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must not exceed max_tokens",
        )
        check(
            len(self.stop) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN for s in self.stop),
            "stop",
            f"must be at most {MAX_STOP_STRINGS} non-empty strings of <= {MAX_STOP_STRING_LEN} "
            "chars",
        )
        check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            check(
                _is_num(getattr(self, name)) and -2 <= getattr(self, name) <= 2,
                name,
                "must be in [-2, 2]",
            )
        check(
            _is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
            "repetition_penalty",
            "must be in (0, 2]",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                name,
                f"must be an integer in [0, {MAX_LOGPROBS}]",
            )
        check(
            self.logit_bias is None
            or (
                len(self.logit_bias) <= MAX_LOGIT_BIAS
                and all(k >= 0 and -100 <= v <= 100 for k, v in self.logit_bias.items())
            ),
            "logit_bias",
            f"must map at most {MAX_LOGIT_BIAS} token ids to biases in [-100, 100]",
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


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # rejects NaN


def check_prompt_len(num_prompt_tokens: int, max_model_len: int) -> None:
    """A prompt must leave room in the model's context; raises `ValueError` otherwise."""
    if num_prompt_tokens > max_model_len:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens, more than max_model_len {max_model_len}"
        )


class FinishReason(enum.StrEnum):
    """Why a completion ended. A `str`, so it reaches msgpack, JSON and metric labels as its
    value ("stop", "length", "abort"): the wire format is the plain string."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
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
    """One sequence being generated: its prompt, what was sampled, how far its KV is computed."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)  # prompt + output
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling (-1 = not yet)
        self.num_preemptions = 0
        # Chained hashes (`kv_cache.BlockHash`) of the full blocks of all_token_ids.
        self.block_hashes: list[bytes] = []

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
