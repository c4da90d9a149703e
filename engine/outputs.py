"""Contracts between the engine's parts: plain data, no behaviour.

scheduler --SchedulerOutput--> model runner --ModelRunnerOutput--> scheduler
scheduler --EngineCoreOutput--> output processor --RequestOutput--> user
scheduler --EngineStats--> user (`LLMEngine.get_stats`)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request import FinishReason, SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class NewRequestData:
    """A request the model runner has not seen: sent in full once."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table so far
    num_computed_tokens: int  # prefix-cache hit


@dataclass
class CachedRequestData:
    """Per-step diffs for requests the runner already holds (parallel lists, one row a request)."""

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # appended; whole table if resumed
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step's tokens


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step, drafts included
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished since the last step: the runner drops their state
    # Preempted since the last step: the runner keeps their state (outputs, generator) but
    # gives up their rows, as a request may be admitted before they resume (priority policy)
    preempted_req_ids: set[str] = field(default_factory=set)
    # req_id -> draft tokens [s] to verify, the last s of its scheduled tokens (none: absent)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Structured outputs: req_id -> its first row of `grammar_bitmask`, for each request with
    # a grammar that samples this step; its s + 1 rows mask its s + 1 sampled positions
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    # [rows, ceil(V / 32)] int32 on the CPU, bit t set = token t allowed; None: no such request
    grammar_bitmask: torch.Tensor | None = None
    # (source, destination) block ids: copies on write of blocks shared with a fork, made
    # before the step's forward (`KVCacheManager.allocate_slots`)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class LogprobsEntry:
    """Logprobs at one position: column 0 is the sampled token (for prompt logprobs, the
    prompt's own token), then the top-N."""

    token_ids: list[int]  # [1 + N]
    logprobs: list[float]  # [1 + N]
    sampled_token_rank: int  # 1-based rank of the sampled token


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # [num_reqs] in the order of the step's batch
    # [num_reqs][0 .. 1 + s]: empty while a prefill is partial; with s drafts scheduled, the
    # accepted ones and one more token (the target's at the first rejection, or a bonus)
    sampled_token_ids: list[list[int]]
    logprobs: list[list[LogprobsEntry]]  # [num_reqs][one per sampled token, or none if not asked]
    # req_id -> one entry per prompt position 1..P-1 ([P - 1]), for the requests asking for
    # prompt logprobs whose prompt was completed by this step; empty for all others
    prompt_logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)
    # [num_reqs][k or fewer] draft tokens proposed for the next step; empty without speculation
    spec_token_ids: list[list[int]] = field(default_factory=list)


@dataclass
class EngineCoreOutput:
    """What one step produced for one request, in tokens."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] = field(default_factory=list)
    prompt_logprobs: list[LogprobsEntry] | None = None  # [P - 1], once, with the first token
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # the request failed a step alone, or its grammar failed (finish_reason ABORT)
    error: str | None = None


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of a request's `n` completions, as vLLM returns it."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # one dict per token, when asked
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's outputs: cumulative from `LLM.generate`, deltas from `LLMEngine.step`.

    A session's turn (`LLMEngine.add_request(resumable=True)`) ends with `finish_reason` set
    on its completion while `finished` stays False: the session waits for its next turn; its
    `prompt_token_ids` are the turn's whole context (every earlier turn's prompt and output,
    then its own prompt). A session closed while waiting (idle past `session_timeout_s`) is
    reported once, `finished` with no `outputs`.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # When asked: per prompt position, None at 0, then the prompt's token and the top-N. A
    # `LLMEngine.step` delta has it once, on the step that completed the prompt.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Why the request failed (finished, no new outputs): a step serving it alone raised
    # this error, which other requests of its batch were spared.
    error: str | None = None


@dataclass(frozen=True)
class UnfinishedRequest:
    """A request the engine still serves, as `LLMEngine.get_unfinished_request` reports it."""

    request_id: str
    num_prompt_tokens: int
    open_indices: list[int]  # choices that have not finished


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load and counters (vLLM's `SchedulerStats`)."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float  # fraction of blocks in use
    num_blocks_in_use: int
    num_tokens_stored: int  # tokens whose KV sits in running requests' blocks
    num_preemptions: int  # since start
    prefix_cache_queries: int  # tokens looked up, since start
    prefix_cache_hits: int  # tokens found, since start
    # Prompt tokens computed, since start: those found in the prefix cache or kept by a
    # session for its next turn are not (a session's turn's prompt is its whole history)
    num_prefill_tokens: int = 0
    # Speculative decoding, since start (vLLM's `SpecDecodingStats`): verification rounds,
    # draft tokens verified, of those accepted, and accepted per draft position [k].
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
