"""Engine configuration: frozen dataclasses, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

_DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "fp8")  # W8A8 int8 (CPU and CUDA); fp8 weights (CUDA with fp8 only)
# auto = the model dtype; bfloat16 under a float32 model halves the cache; fp8 = e4m3 with scales
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3")
SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's: fcfs = arrival order; priority = lowest `priority` first, ties by arrival
SCHEDULING_POLICIES = ("fcfs", "priority")
# Drafts longer than this are all but never accepted whole (acceptance decays per position)
# and each proposed token costs a verified row whether accepted or not.
MAX_NUM_SPECULATIVE_TOKENS = 8


def _checker(config: object):
    def check(ok: bool, name: str, why: str) -> None:
        if not ok:
            raise ValueError(f"{name} {why}, got {getattr(config, name)!r}")

    return check


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): a proposer guesses the next
    `num_speculative_tokens` tokens of a request, the target verifies them in its next step.

    - `ngram`: the continuation of the latest earlier occurrence, in the request's own prompt
      and output, of its last `prompt_lookup_max` .. `prompt_lookup_min` tokens;
    - `draft_model`: greedy tokens of a smaller model (`model`) sharing the target's
      vocabulary, with its own paged KV cache on the target's block tables.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # ngram: longest suffix looked up
    prompt_lookup_min: int = 2  # ngram: shortest suffix looked up
    model: str | None = None  # draft_model: HF folder or .gguf file
    # Steps with at least this many requests run without speculation; None: never off; "auto":
    # the crossover measured for the machine, where it was (`auto_disable_by_batch_size`).
    disable_by_batch_size: int | str | None = "auto"

    def __post_init__(self) -> None:
        check = _checker(self)
        check(self.method in SPECULATIVE_METHODS, "method", f"must be one of {SPECULATIVE_METHODS}")
        check(
            _is_int(self.num_speculative_tokens)
            and 1 <= self.num_speculative_tokens <= MAX_NUM_SPECULATIVE_TOKENS,
            "num_speculative_tokens",
            f"must be an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}]",
        )
        check(
            _is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1,
            "prompt_lookup_min",
            "must be an integer >= 1",
        )
        check(
            _is_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min,
            "prompt_lookup_max",
            "must be an integer >= prompt_lookup_min",
        )
        check(
            (self.model is not None) == (self.method == "draft_model"),
            "model",
            "must be given for method 'draft_model' and only for it",
        )
        check(
            self.disable_by_batch_size in (None, "auto")
            or (_is_int(self.disable_by_batch_size) and self.disable_by_batch_size >= 1),
            "disable_by_batch_size",
            "must be None, 'auto' or an integer >= 1",
        )

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> SpeculativeConfig:
        """From vLLM's `speculative_config` dict; an unknown key is an error."""
        if not isinstance(options, dict):
            raise ValueError(f"speculative_config must be a dict, got {options!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        for name in ("method", "num_speculative_tokens"):
            if name not in options:
                raise ValueError(f"speculative_config needs {name!r}")
        return cls(**options)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine instance. Keyword names follow vLLM's `LLM(...)`."""

    model: str | None = None  # HF folder or .gguf file; None = SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto = bfloat16 on CUDA and AVX512-BF16 CPUs, else float32
    device: str = "auto"  # auto = cuda if available, else cpu
    seed: int = 0
    # auto = triton on CUDA, cpu (the C decode kernel) on a CPU with a C compiler, else torch
    attention_backend: str = "auto"
    quantization: str | None = None  # None = weights in `dtype`; see QUANTIZATIONS
    kv_cache_dtype: str = "auto"  # see KV_CACHE_DTYPES
    # Cache
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # exactly this many blocks when set
    kv_cache_memory_bytes: int = 1 << 30  # otherwise the pool is sized from this budget (CPU)
    # CUDA: the pool takes this share of device memory, minus weights and profiled activations.
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False  # no decode graphs (CUDA graphs, or CPU graphs of C kernels)
    enable_prefix_caching: bool = True
    # Scheduler
    max_num_seqs: int = 128  # running requests at once
    max_num_batched_tokens: int = 2048  # the per-step token_budget
    max_model_len: int | None = None  # None = the model's max_position_embeddings, capped at 8192
    long_prefill_token_threshold: int = 0  # >0: a prefill takes at most this many tokens a step
    max_waiting_requests: int = 4096  # add_request beyond this raises (overload is answered)
    scheduling_policy: str = "fcfs"  # see SCHEDULING_POLICIES
    # A session waiting for its next chunk (`add_request(resumable=True)`) this long is closed
    # and its KV blocks freed
    session_timeout_s: float = 300.0
    # None = no speculative decoding; a dict is read as `SpeculativeConfig.from_dict`
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        check = _checker(self)
        if isinstance(self.speculative_config, dict):
            spec = SpeculativeConfig.from_dict(self.speculative_config)
            object.__setattr__(self, "speculative_config", spec)
        check(
            self.speculative_config is None
            or isinstance(self.speculative_config, SpeculativeConfig),
            "speculative_config",
            "must be None, a dict or a SpeculativeConfig",
        )
        check(self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}")
        check(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            "quantization",
            f"must be None or one of {QUANTIZATIONS}",
        )
        check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"must be one of {KV_CACHE_DTYPES}",
        )
        check(self.block_size in (8, 16, 32), "block_size", "must be 8, 16 or 32")
        check(
            self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks", "must be >= 2"
        )
        check(self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", "must be > 0")
        check(
            0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]"
        )
        check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        check(
            self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be >= 1"
        )
        check(
            self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold", "must be >= 0"
        )
        check(self.max_waiting_requests >= 1, "max_waiting_requests", "must be >= 1")
        check(
            self.scheduling_policy in SCHEDULING_POLICIES,
            "scheduling_policy",
            f"must be one of {SCHEDULING_POLICIES}",
        )
        check(
            isinstance(self.session_timeout_s, int | float)
            and not isinstance(self.session_timeout_s, bool)
            and 0 < self.session_timeout_s < math.inf,
            "session_timeout_s",
            "must be a finite number of seconds > 0",
        )

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build from `LLM(**kwargs)`; an unknown keyword is an error, not silently ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs, resolved against the model (max_model_len is known)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int = 0
    max_waiting_requests: int = 4096
    policy: str = "fcfs"  # EngineConfig.scheduling_policy
    session_timeout_s: float = 300.0  # EngineConfig.session_timeout_s
    num_speculative_tokens: int = 0  # drafts a request may carry into a step (0: none)
    # KV slots reserved past a step's tokens: the draft model writes its drafts' KV there
    num_lookahead_tokens: int = 0


@dataclass(frozen=True)
class CacheConfig:
    """The KV pool as allocated: the number of blocks is final here."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
