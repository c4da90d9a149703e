"""Priority scheduling under overload: the TTFT of a stream of high-priority requests while a
backlog of low-priority ones fills every seat, against the same stream on an idle engine.

In-process, as `benchmarks.sweep`: an offline `LLMEngine` driven by `add_request`/`step`
(`common.run_timed_offline`). Runs of the same seeded requests, on engines of each token
budget of `--max-num-batched-tokens`:
- alone: each request of the high-priority stream alone, one after the other (for reference);
- idle: the stream alone at its arrival times (its requests meet each other, nothing else);
- priority: the stream (priority 0) arriving while a backlog of priority 1 keeps the engine
  overloaded: `--low-in-flight` requests unfinished (every one of `--max-num-seqs` seats
  taken, the rest waiting), each one that finishes replaced at once (`Backlog`);
- fcfs: the same on an engine with the default policy, everything at priority 0: what the
  stream would wait without priorities.

Target (issue 15): the stream's TTFT p99 under the overload within 2x its idle TTFT p99. A
high-priority request jumps the waiting queue and, finding every seat taken, preempts the
lowest-priority running request for one (vLLM v0's rule: under v1's, taking the next seat
that frees, its wait grew with the time between two completions of the backlog, 7.7x idle);
its prompt's step computes no low-priority prompt (`Scheduler._prefill_rank`). What is left
is the step in flight when it arrives, which the backlog's prompts make long: about 1 ms a
token in bf16 on a Zen 4 EPYC, 3.3 in float32 on a Zen 3 one, so the token budget bounds that
wait. The backlog drains once the stream is done, every request of it finishing; the table
counts the preemptions.

    python -m benchmarks.priority
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from benchmarks.common import (
    BenchRequest,
    arrival_offsets,
    corpus_token_ids,
    fmt,
    greedy_params,
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
    add(
        "--low-in-flight",
        type=int,
        default=32,
        help="priority-1 requests kept unfinished while the stream lasts (above --max-num-seqs)",
    )
    add("--low-input-len", type=parse_range, default=(64, 256))
    add("--low-output-len", type=parse_range, default=(16, 48))
    add("--num-high", type=int, default=96, help="priority-0 requests, a Poisson stream")
    add("--high-rate", type=float, default=2.0, help="requests/s of the high-priority stream")
    add("--high-input-len", type=parse_range, default=(32, 96))
    add("--high-output-len", type=parse_range, default=(8, 8))
    add("--seed", type=int, default=0)
    add("--name", default="priority", help="results/<name>.json and .md")
    args = parser.parse_args(argv)
    if args.low_in_flight <= args.max_num_seqs:
        parser.error("--low-in-flight must exceed --max-num-seqs: the backlog overloads the seats")
    return args


def stream(args: argparse.Namespace, token_ids: list[int]) -> tuple[list, list[float]]:
    """The high-priority stream (priority 0) and its arrival offsets."""
    high = [
        replace(r, request_id=f"high-{i}")
        for i, r in enumerate(
            make_workload(
                token_ids, args.num_high, args.high_input_len, args.high_output_len, args.seed + 7
            )
        )
    ]
    return high, arrival_offsets(args.num_high, args.high_rate, 1.0, args.seed)


def backlog_requests(
    args: argparse.Namespace, token_ids: list[int], priority: int
) -> Iterator[BenchRequest]:
    """An endless seeded supply of backlog requests, the same in every run."""
    for batch in itertools.count():
        workload = make_workload(
            token_ids, 256, args.low_input_len, args.low_output_len, args.seed + 1000 + batch
        )
        for i, request in enumerate(workload):
            yield replace(request, request_id=f"low-{batch}-{i}", priority=priority)


class Backlog:
    """An `LLMEngine` as `run_timed_offline` drives it, with a backlog beside the stream:
    `num_in_flight` requests kept unfinished, each one that finishes replaced at once, until the
    stream's last request has finished; then the backlog drains.

    A closed loop, so the overload lasts as long as the stream on every CPU kind: 128 requests
    sent at once (this benchmark until 2026-12-08) were done halfway through the stream on an
    AMX Xeon and ran 100 s past it on a Zen 3 EPYC. `fill` steps until every seat has had its
    first token before the stream starts, so no stream request lands on the backlog's first
    step, which prefills a prompt for every seat at once (3.0-3.6 s on the Zen 3 EPYC in
    float32: `fill_s` in the results)."""

    def __init__(
        self,
        engine: Any,
        requests: Iterator[BenchRequest],
        num_in_flight: int,
        stream_ids: list[str],
    ) -> None:
        self.engine = engine
        self.requests = requests
        self.num_in_flight = num_in_flight
        self.stream_left = set(stream_ids)  # stream requests not finished yet
        # unfinished backlog request id -> when it was added, None once its first token came
        self.in_flight: dict[str, float | None] = {}
        self.ttfts: list[float] = []  # seconds, one per backlog request that had a token
        self.num_completed = 0

    def add_request(self, *args: Any, **kwargs: Any) -> None:
        self.engine.add_request(*args, **kwargs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.stream_left) or self.engine.has_unfinished_requests()

    def fill(self, num_seats: int) -> None:
        while len(self.ttfts) < num_seats:
            self.step()

    def step(self) -> list:
        while self.stream_left and len(self.in_flight) < self.num_in_flight:
            request = next(self.requests)
            params = greedy_params(request.output_len)
            self.engine.add_request(
                request.request_id, request.prompt_token_ids, params, priority=request.priority
            )
            self.in_flight[request.request_id] = time.perf_counter()
        stream_outputs = []
        for output in self.engine.step():
            if output.request_id not in self.in_flight:
                if output.finished:
                    self.stream_left.discard(output.request_id)
                stream_outputs.append(output)
                continue
            start = self.in_flight[output.request_id]
            if start is not None and output.error is None:
                self.ttfts.append(time.perf_counter() - start)
                self.in_flight[output.request_id] = None
            if output.finished:
                del self.in_flight[output.request_id]
                self.num_completed += output.error is None
        return stream_outputs


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


def run_loaded(
    engine: Any,
    args: argparse.Namespace,
    backlog: Iterator[BenchRequest],
    high: list,
    high_offsets: list[float],
) -> dict[str, Any]:
    """TTFTs of the stream arriving during the backlog, and how the backlog fared."""
    loaded = Backlog(engine, backlog, args.low_in_flight, [r.request_id for r in high])
    start = time.perf_counter()
    loaded.fill(args.max_num_seqs)
    fill_s = time.perf_counter() - start
    timings, duration = run_timed_offline(loaded, high, high_offsets)
    return {
        "duration_s": duration,
        "fill_s": fill_s,
        "high_ttft": latency_summary([t.ttft for t in timings if t.ok]),
        "high_completed": sum(t.ok for t in timings),
        "low_ttft": latency_summary(loaded.ttfts),
        "low_completed": loaded.num_completed,
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

    token_ids = corpus_token_ids(fresh("fcfs").tokenizer)
    high, high_offsets = stream(args, token_ids)
    results = {
        "alone": run_idle(fresh("priority"), high, None),
        "idle": run_idle(fresh("priority"), high, high_offsets),
        "priority": run_loaded(
            fresh("priority"), args, backlog_requests(args, token_ids, 1), high, high_offsets
        ),
        # fcfs takes priority 0 only: the same requests, no one ahead of anyone
        "fcfs": run_loaded(
            fresh("fcfs"), args, backlog_requests(args, token_ids, 0), high, high_offsets
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
                fmt(result.get("low_completed")),
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
            f"{args.high_output_len[1]}) at {args.high_rate} req/s, while a backlog keeps"
            f" {args.low_in_flight} priority-1 requests (inputs {args.low_input_len[0]}-"
            f"{args.low_input_len[1]}, outputs {args.low_output_len[0]}-"
            f"{args.low_output_len[1]}) unfinished, each one that finishes replaced, the stream"
            f" starting once every seat has had its first token; max_num_seqs"
            f" {args.max_num_seqs}, dtype {args.dtype}, greedy; engines of each token budget"
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
