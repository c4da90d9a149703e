"""Shared pieces of the benchmarks: workload, arrivals, latency metrics, results, compute limit.

Everything that two scripts need lives here, so they measure the same way: the same seeded
workload of real English text, the same TTFT/TPOT/ITL definitions, the same result files.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# kvrail configurations the benchmarks compare (`--configs`): name -> `LLM` options.
ENGINE_CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "int8": {"quantization": "int8"},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "int8-fp8-kv": {"quantization": "int8", "kv_cache_dtype": "fp8"},
    "bf16-kv": {"kv_cache_dtype": "bfloat16"},  # float32 models; a bf16 one stores bf16 anyway
    "int8-bf16-kv": {"quantization": "int8", "kv_cache_dtype": "bfloat16"},
}

# The full workload's KV pool on CPU (`LLM(kv_cache_memory_bytes=...)`): 128 requests of up to
# 768 tokens fit without preemption in fp32 too (the engine's default, 1 GiB, preempts there).
FULL_WORKLOAD_KV_BYTES = 4 << 30

# Prompt text: the docstrings of these stdlib modules and their public members. Real English
# (prefill cost and attention patterns differ from repeated tokens), and it needs no download.
CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "dataclasses", "datetime", "decimal",
    "email.message", "functools", "inspect", "io", "itertools", "json", "logging", "os",
    "pathlib", "re", "shutil", "socket", "statistics", "string", "subprocess", "tarfile",
    "threading", "typing", "unittest", "urllib.parse", "zipfile",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: a window of corpus tokens and how many tokens to generate;
    `priority` for an engine that schedules by it (`benchmarks.priority`)."""

    request_id: str
    prompt_token_ids: list[int]
    output_len: int
    priority: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def corpus_text() -> str:
    """The docstrings of `CORPUS_MODULES` and their public members, in a fixed order."""
    docs = []
    for module_name in CORPUS_MODULES:
        module = importlib.import_module(module_name)
        docs.append(inspect.getdoc(module) or "")
        for name in sorted(vars(module)):
            member = getattr(module, name)
            if name.startswith("_") or not (inspect.isclass(member) or inspect.isfunction(member)):
                continue
            docs.append(inspect.getdoc(member) or "")
    return "\n\n".join(d for d in docs if d)


def corpus_token_ids(tokenizer: Any) -> list[int]:
    """The corpus as one token stream; prompts are windows of it."""
    return tokenizer.encode(corpus_text(), add_special_tokens=False)


def sample_lengths(
    num_requests: int, input_range: Sequence[int], output_range: Sequence[int], seed: int
) -> list[tuple[int, int]]:
    """(input_len, output_len) pairs drawn uniformly from the inclusive ranges."""
    rng = random.Random(seed)
    return [(rng.randint(*input_range), rng.randint(*output_range)) for _ in range(num_requests)]


def make_workload(
    token_ids: Sequence[int],
    num_requests: int,
    input_range: Sequence[int],
    output_range: Sequence[int],
    seed: int,
) -> list[BenchRequest]:
    """Seeded requests whose prompts are windows of `token_ids` at random offsets."""
    if input_range[1] > len(token_ids):
        raise ValueError(f"corpus has {len(token_ids)} tokens, fewer than {input_range[1]}")
    lengths = sample_lengths(num_requests, input_range, output_range, seed)
    # A separate stream for offsets: changing the corpus does not change the lengths.
    rng = random.Random(seed + 1)
    workload = []
    for i, (input_len, output_len) in enumerate(lengths):
        offset = rng.randint(0, len(token_ids) - input_len)
        prompt = list(token_ids[offset : offset + input_len])
        workload.append(BenchRequest(f"bench-{seed}-{i}", prompt, output_len))
    return workload


def seeded_subset(workload: Sequence[BenchRequest], size: int, seed: int) -> list[BenchRequest]:
    """`size` requests of the workload picked at random (all of it when it is smaller)."""
    if size >= len(workload):
        return list(workload)
    return random.Random(seed).sample(list(workload), size)


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float, seed: int
) -> list[float]:
    """Seconds after the start at which each request is sent, as `vllm bench serve` does.

    Gaps are gamma-distributed with mean 1/rate: shape `burstiness` 1 is a Poisson process,
    below 1 burstier, above 1 more regular. An infinite rate sends everything at once.
    """
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    return np.cumsum(gaps).tolist()


# ---------------------------------------------------------------------------------------------
# Latency metrics
# ---------------------------------------------------------------------------------------------


@dataclass
class RequestTiming:
    """When one request was sent and when each of its chunks (tokens) arrived."""

    start: float
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_len: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        if self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive chunks."""
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]


def latency_summary(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean, median and p99 in milliseconds (None when there is no value)."""
    if not values_s:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return {
        "mean_ms": float(ms.mean()),
        "median_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
    }


def summarize_timings(timings: Sequence[RequestTiming], duration_s: float) -> dict[str, Any]:
    """vLLM-style serving metrics over the requests that completed."""
    done = [t for t in timings if t.ok]
    output_tokens = sum(t.output_tokens for t in done)
    input_tokens = sum(t.prompt_len for t in done)
    return {
        "completed": len(done),
        "failed": len(timings) - len(done),
        "duration_s": duration_s,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft": latency_summary([t.ttft for t in done]),
        "tpot": latency_summary([t.tpot for t in done if t.tpot is not None]),
        "itl": latency_summary([gap for t in done for gap in t.itls]),
        "e2e": latency_summary([t.e2e for t in done]),
    }


def latency_rows(summary: dict[str, Any]) -> list[list[str]]:
    """Table rows (metric, mean, median, p99) for a `summarize_timings` result."""
    rows = []
    for metric in ("ttft", "tpot", "itl", "e2e"):
        stats = summary[metric]
        rows.append([metric.upper() + " (ms)", *(fmt(stats[k]) for k in stats)])
    return rows


# ---------------------------------------------------------------------------------------------
# The offline engine under timed arrivals (serve.py's baseline, sweep.py)
# ---------------------------------------------------------------------------------------------


def greedy_params(output_len: int) -> Any:
    """Exactly `output_len` tokens, greedy: every system does the same work."""
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def run_timed_offline(
    engine: Any,
    workload: Sequence[BenchRequest],
    offsets: Sequence[float],
    max_concurrency: int | None = None,
    progress: Any = None,
) -> tuple[list[RequestTiming], float]:
    """Drive an `LLMEngine` with `add_request`/`step`, adding each request at its arrival.

    A request's clock starts at its arrival, or when a concurrency slot frees up if all were
    taken, as a serving client's would. Returns the timings and the wall time of the run.
    """
    limit = max_concurrency or len(workload)
    pending = sorted(zip(offsets, workload, strict=True), key=lambda p: p[0])
    # Built before the clock starts: the first call imports the engine package.
    params = {r.request_id: greedy_params(r.output_len) for r in workload}
    timings: dict[str, RequestTiming] = {}
    in_flight = 0
    slot_free_since = 0.0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now and in_flight < limit:
            offset, request = pending.pop(0)
            timings[request.request_id] = RequestTiming(
                start=t0 + max(offset, slot_free_since), prompt_len=request.prompt_len
            )
            engine.add_request(
                request.request_id,
                request.prompt_token_ids,
                params[request.request_id],
                priority=request.priority,
            )
            in_flight += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(pending[0][0] - now, 0.05)))  # idle until the next arrival
            continue
        was_full = in_flight >= limit
        for output in engine.step():
            timing = timings[output.request_id]
            if output.error is not None:
                timing.error = output.error  # a failed request ends with no outputs
            else:
                timing.chunk_times.append(time.perf_counter())
            timing.output_tokens += sum(len(c.token_ids) for c in output.outputs)
            if output.finished:
                in_flight -= 1
                if progress is not None:
                    progress.update(1)
        if was_full and in_flight < limit:
            slot_free_since = time.perf_counter() - t0
    return [timings[r.request_id] for r in workload], time.perf_counter() - t0


def warm_up(engine: Any) -> None:
    """One short request: an engine's first steps pay one-off costs (allocation, kernels)."""
    request = BenchRequest("warm-up", list(range(100, 148)), 4)  # ids no real prompt starts with
    run_timed_offline(engine, [request], [0.0])


# ---------------------------------------------------------------------------------------------
# The machine's compute limit for this model
# ---------------------------------------------------------------------------------------------


def linear_shapes(config: Any) -> list[tuple[int, int]]:
    """(in, out) of every matmul of one token's forward pass, LM head included."""
    from engine.models.llama import head_dim_of

    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = head_dim_of(config)
    q_out = config.num_attention_heads * head_dim
    kv_out = config.num_key_value_heads * head_dim
    layer = [(hidden, q_out), (hidden, kv_out), (hidden, kv_out), (q_out, hidden)]
    layer += [(hidden, inter), (hidden, inter), (inter, hidden)]
    return layer * config.num_hidden_layers + [(hidden, config.vocab_size)]


def model_flops_per_token(config: Any) -> float:
    """2 x matmul parameters (LM head included); attention over the context is left out."""
    return 2.0 * sum(n_in * n_out for n_in, n_out in linear_shapes(config))


def measure_matmul_flops(config: Any, num_tokens: int, dtype: str, seconds: float = 2.0) -> float:
    """FLOP/s of this model's matmuls on `num_tokens` rows, timed over about `seconds` each
    way they can run here: torch's matmul, and in bf16 on an AVX512-BF16 CPU kvrail's packed
    kernel too (`engine.kernels.cpu_linear.linear_bf16_packed`); the faster."""
    import torch

    from engine.models.layers import packs_bf16

    torch_dtype = getattr(torch, dtype)
    # One layer's distinct shapes plus the LM head; the model repeats them layer after layer.
    shapes = sorted(set(linear_shapes(config)))
    weights = [torch.randn(n_out, n_in, dtype=torch_dtype) for n_in, n_out in shapes]
    inputs = [torch.randn(num_tokens, n_in, dtype=torch_dtype) for n_in, _ in shapes]
    flops_per_round = sum(2.0 * num_tokens * w.numel() for w in weights)
    ways = [(torch.nn.functional.linear, weights)]
    if packs_bf16(torch_dtype):
        from engine.kernels.cpu_linear import linear_bf16_packed, pack_bf16

        ways.append((linear_bf16_packed, [pack_bf16(w, None, False) for w in weights]))
    rates = []
    with torch.inference_mode():
        for linear, ws in ways:
            for x, w in zip(inputs, ws, strict=True):  # warm-up: first calls pick kernels
                linear(x, w)
            rounds, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                for x, w in zip(inputs, ws, strict=True):
                    linear(x, w)
                rounds += 1
            rates.append(rounds * flops_per_round / (time.perf_counter() - start))
    return max(rates)


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def fmt(value: float | int | str | None, digits: int = 1) -> str:
    """A table cell: numbers rounded, None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(value: float | None, target: float, higher_is_better: bool = True) -> str:
    """PASS/FAIL against a target (n/a when the value could not be measured)."""
    if value is None:
        return "n/a"
    ok = value >= target if higher_is_better else value <= target
    return "PASS" if ok else "FAIL"


def write_results(name: str, payload: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Write `results/<name>.json` and `results/<name>.md`; print the markdown."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    json_path = RESULTS_DIR / f"{name}.json"
    md_path = RESULTS_DIR / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    print(markdown)
    print(f"\nwrote {json_path} and {md_path}")
    return json_path, md_path


def parse_range(text: str) -> tuple[int, int]:
    """'64:512' (or a single '128') as an inclusive (low, high) range for argparse."""
    low, _, high = text.partition(":")
    low_value, high_value = int(low), int(high or low)
    if not 1 <= low_value <= high_value:
        raise ValueError(f"bad range {text!r}: want LOW:HIGH with 1 <= LOW <= HIGH")
    return low_value, high_value
