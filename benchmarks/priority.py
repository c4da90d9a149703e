"""Priority scheduling under overload: the TTFT of a stream of high-priority requests while a
backlog of low-priority ones fills every seat, against the same stream on an idle engine.

In-process, as `benchmarks.sweep`: an offline `LLMEngine` driven by `add_request`/`step`
(`common.run_timed_offline`). Runs of the same seeded requests, on engines of each token
budget of `--max-num-batched-tokens`:
- alone: each request of the high-priority stream alone, one after the other (for reference);
- idle: the stream alone at its arrival times (its requests meet each other, nothing else);
- priority: the stream (priority 0) arriving while `--num-low` requests of priority 1, all
  sent at once, keep the engine overloaded (far more than `--max-num-seqs` seats);
- fcfs: the same on an engine with the default policy, everything at priority 0: what the
  stream would wait without priorities.

Target (issue 15): the stream's TTFT p99 under the overload within 2x its idle TTFT p99. A
high-priority request jumps the waiting queue and, finding every seat taken, preempts the
lowest-priority running request for one (vLLM v0's rule: under v1's, taking the next seat
that frees, its wait grew with the time between two completions of the backlog, 7.7x idle);
its prompt's step computes no low-priority prompt (`Scheduler._prefill_rank`). What is left
is the step in flight when it arrives: on these CPUs a step of the backlog's prompts costs
about 1 ms a token, so the token budget bounds that wait (1.1 s for the 1,325 tokens of the
backlog's first step at the default 2,048). Every low-priority request still finishes; the
table counts the preemptions.

    python -m benchmarks.priority
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

from benchmarks.common import (
    arrival_offsets,
    corpus_token_ids,
    fmt,
    latency_summary,
    make_workload,
    markdown_table,
    parse_range,
    run_timed_offline,
    verdict,
    warm_up,
    write_results,
)

TARGET_RATIO = 2.0  # loaded TTFT p99 / idle TTFT p99 of the high-priority stream


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    add("--dtype", default="auto")
    add("--max-num-seqs", type=int, default=8, help="seats: the backlog keeps them all taken")
    add(
        "--max-num-batched-tokens",
        type=lambda v: [int(b) for b in v.split(",")],
        default=[2048, 512],
        help="comma list of token budgets, each run on its own engines (2048: the default)",
    )
    add("--num-low", type=int, default=128, help="priority-1 requests, all sent at the start")
    add("--low-input-len", type=parse_range, default=(64, 256))
    add("--low-output-len", type=parse_range, default=(16, 48))
    add("--num-high", type=int, default=48, help="priority-0 requests, a Poisson stream")
    add("--high-rate", type=float, default=2.0, help="requests/s of the high-priority stream")
    add("--high-start-s", type=float, default=0.5, help="the stream starts once the backlog runs")
    add("--high-input-len", type=parse_range, default=(32, 96))
    add("--high-output-len", type=parse_range, default=(8, 8))
    add("--seed", type=int, default=0)
    add("--name", default="priority", help="results/<name>.json and .md")
    return parser.parse_args(argv)


def workloads(args: argparse.Namespace, token_ids: list[int]) -> tuple[list, list, list]:
    """The backlog (priority 1) and the stream (priority 0) with the stream's offsets."""
    low = [
        replace(r, request_id=f"low-{i}", priority=1)
        for i, r in enumerate(
            make_workload(
                token_ids, args.num_low, args.low_input_len, args.low_output_len, args.seed
            )
        )
    ]
    high = [
        replace(r, request_id=f"high-{i}")
        for i, r in enumerate(
            make_workload(
                token_ids, args.num_high, args.high_input_len, args.high_output_len, args.seed + 7
            )
        )
    ]
    offsets = arrival_offsets(args.num_high, args.high_rate, 1.0, args.seed)
    return low, high, [args.high_start_s + o for o in offsets]


def run_idle(engine: Any, high: list, high_offsets: list[float] | None) -> dict[str, Any]:
    """TTFTs of the stream arriving at its times on an engine serving nothing else, or
    (`high_offsets` None) of each of its requests alone, one after another."""
    start = time.perf_counter()
    if high_offsets is None:
        stream = [run_timed_offline(engine, [request], [0.0])[0][0] for request in high]
    else:
        stream = run_timed_offline(engine, high, high_offsets)[0]
    return {
        "duration_s": time.perf_counter() - start,
        "high_ttft": latency_summary([t.ttft for t in stream if t.ok]),
        "high_completed": sum(t.ok for t in stream),
    }


def run_loaded(engine: Any, low: list, high: list, high_offsets: list[float]) -> dict[str, Any]:
    """TTFTs of the stream arriving during the backlog, and how the backlog fared."""
    timings, duration = run_timed_offline(engine, high + low, high_offsets + [0.0] * len(low))
    stream, backlog = timings[: len(high)], timings[len(high) :]
    return {
        "duration_s": duration,
        "high_ttft": latency_summary([t.ttft for t in stream if t.ok]),
        "high_completed": sum(t.ok for t in stream),
        "low_ttft": latency_summary([t.ttft for t in backlog if t.ok]),
        "low_completed": sum(t.ok for t in backlog),
        "preemptions": engine.get_stats().num_preemptions,
    }


def run_budget(args: argparse.Namespace, budget: int) -> tuple[dict[str, Any], list[list[str]]]:
    """The runs on engines of one token budget: their results and table rows."""
    from engine import LLMEngine

    options = dict(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget,
    )

    def fresh(policy: str) -> Any:
        """An engine of its own for each run: none finds another run's prompts cached."""
        engine = LLMEngine.from_kwargs(scheduling_policy=policy, **options)
        warm_up(engine)
        return engine

    low, high, high_offsets = workloads(args, corpus_token_ids(fresh("fcfs").tokenizer))
    results = {
        "alone": run_idle(fresh("priority"), high, None),
        "idle": run_idle(fresh("priority"), high, high_offsets),
        "priority": run_loaded(fresh("priority"), low, high, high_offsets),
        # fcfs takes priority 0 only: the same requests, no one ahead of anyone
        "fcfs": run_loaded(
            fresh("fcfs"), [replace(r, priority=0) for r in low], high, high_offsets
        ),
    }
    idle_p99 = results["idle"]["high_ttft"]["p99_ms"]
    for name in ("alone", "priority", "fcfs"):
        results[name]["ratio_to_idle_p99"] = results[name]["high_ttft"]["p99_ms"] / idle_p99
    rows = []
    for name, result in results.items():
        high_ttft, low_ttft = result["high_ttft"], result.get("low_ttft", {})
        rows.append(
            [
                str(budget),
                name,
                fmt(high_ttft["median_ms"]),
                fmt(high_ttft["p99_ms"]),
                fmt(result.get("ratio_to_idle_p99"), 2),
                f"{result['high_completed']}/{len(high)}",
                fmt(low_ttft.get("median_ms")),
                f"{result['low_completed']}/{len(low)}" if "low_completed" in result else "-",
                fmt(result.get("preemptions")),
                fmt(result["duration_s"], 2),
            ]
        )
    return results, rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results, rows, verdicts = {}, [], []
    for budget in args.max_num_batched_tokens:
        results[budget], budget_rows = run_budget(args, budget)
        rows += budget_rows
        ratio = results[budget]["priority"]["ratio_to_idle_p99"]
        verdicts.append(
            f"- token budget {budget}: {fmt(ratio, 2)}x,"
            f" {verdict(ratio, TARGET_RATIO, higher_is_better=False)}"
        )
    headers = [
        "token budget",
        "run",
        "high TTFT p50 ms",
        "high TTFT p99 ms",
        "p99 / idle p99",
        "high done",
        "low TTFT p50 ms",
        "low done",
        "preemptions",
        "duration s",
    ]
    markdown = "\n".join(
        [
            "# Priority scheduling under overload",
            "",
            f"{args.num_high} priority-0 requests (inputs {args.high_input_len[0]}-"
            f"{args.high_input_len[1]}, outputs {args.high_output_len[0]}-"
            f"{args.high_output_len[1]}) at {args.high_rate} req/s from {args.high_start_s} s,"
            f" while {args.num_low} priority-1 requests (inputs {args.low_input_len[0]}-"
            f"{args.low_input_len[1]}, outputs {args.low_output_len[0]}-"
            f"{args.low_output_len[1]}) are all sent at 0 s; max_num_seqs {args.max_num_seqs},"
            f" dtype {args.dtype}, greedy; engines of each token budget"
            " (`max_num_batched_tokens`). alone: each stream request alone, one after another;"
            " idle: the stream alone at its arrival times; priority: the stream during the"
            " backlog; fcfs: the same load on the default policy.",
            "",
            markdown_table(headers, rows),
            "",
            f"Target: high-priority TTFT p99 under overload <= {TARGET_RATIO:.0f}x idle:",
            *verdicts,
        ]
    )
    write_results(args.name, {"args": vars(args), "results": results}, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
