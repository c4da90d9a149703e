"""The latency cliff: TTFT and TPOT against offered load, for several token budgets.

In-process, without HTTP or Redis: requests arrive as a gamma process at each rate and an
offline `LLMEngine` is driven by `add_request`/`step` (see `common.run_timed_offline`), so
the curves show the scheduler and the model, not network noise. Each point runs a fresh
seeded workload (no prefix-cache hits across points). Without `--request-rates`, rates are
fractions of the capacity measured first (all requests at once, the largest budget), so
the sweep straddles the cliff however fast the engine is.

Writes results/<name>.json, .md and .png (TTFT and TPOT medians against load, one line per
`max_num_batched_tokens`, preemptions marked).

    python -m benchmarks.sweep --budgets 256,1024,4096 --load-fractions 0.25,0.5,1,1.5
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from benchmarks.common import (
    RESULTS_DIR,
    arrival_offsets,
    corpus_token_ids,
    fmt,
    make_workload,
    markdown_table,
    parse_range,
    run_timed_offline,
    summarize_timings,
    warm_up,
    write_results,
)

KNEE_FACTOR = 2.0  # latency is no longer flat once the median is this many times the lightest


def parse_list(text: str, kind: type = float) -> list:
    return [kind(item) for item in text.split(",") if item]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", default=None)
    add("--dtype", default="auto")
    add(
        "--budgets",
        type=lambda t: parse_list(t, int),
        default=[256, 1024, 4096],
        help="max_num_batched_tokens values, comma separated",
    )
    add("--max-num-seqs", type=int, default=64)
    add("--num-kv-blocks", type=int, default=None, help="a small pool shows preemption")
    add("--max-model-len", type=int, default=None)
    add("--request-rates", type=parse_list, default=None, help="req/s, comma separated")
    add(
        "--load-fractions",
        type=parse_list,
        default=[0.25, 0.5, 0.75, 1.0, 1.25, 1.5],
        help="rates as fractions of the measured capacity (without --request-rates)",
    )
    add("--num-requests", type=int, default=32, help="requests per point")
    add("--input-len", type=parse_range, default=(64, 512))
    add("--output-len", type=parse_range, default=(64, 256))
    add("--burstiness", type=float, default=1.0)
    add("--seed", type=int, default=0)
    add("--name", default="sweep")
    return parser.parse_args(argv)


def build_engine(args: argparse.Namespace, budget: int) -> Any:
    from engine import LLMEngine

    options = {"num_kv_blocks": args.num_kv_blocks, "max_model_len": args.max_model_len}
    engine = LLMEngine.from_kwargs(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget,
        **{k: v for k, v in options.items() if v is not None},
    )
    warm_up(engine)
    return engine


def measure_capacity(args: argparse.Namespace, tokens: list[int]) -> float:
    """Requests/s with everything queued at once, at the largest budget."""
    engine = build_engine(args, max(args.budgets))
    workload = make_workload(
        tokens, args.num_requests, args.input_len, args.output_len, args.seed + 999
    )
    with tqdm(total=len(workload), desc="capacity") as bar:
        timings, seconds = run_timed_offline(engine, workload, [0.0] * len(workload), None, bar)
    return summarize_timings(timings, seconds)["request_throughput"]


def sweep_budget(
    args: argparse.Namespace, tokens: list[int], budget: int, rates: list[float]
) -> list[dict[str, Any]]:
    """One engine at `budget`, one point per rate."""
    engine = build_engine(args, budget)
    points = []
    for index, rate in enumerate(rates):
        seed = args.seed + 1 + index  # fresh prompts per point: no prefix-cache hits
        workload = make_workload(tokens, args.num_requests, args.input_len, args.output_len, seed)
        offsets = arrival_offsets(len(workload), rate, args.burstiness, seed)
        preemptions_before = engine.get_stats().num_preemptions
        with tqdm(total=len(workload), desc=f"budget {budget} @ {rate:.2f} req/s") as bar:
            timings, seconds = run_timed_offline(engine, workload, offsets, None, bar)
        summary = summarize_timings(timings, seconds)
        points.append(
            {
                "budget": budget,
                "request_rate": rate,
                "achieved_rate": summary["request_throughput"],
                "output_throughput": summary["output_throughput"],
                "ttft": summary["ttft"],
                "tpot": summary["tpot"],
                "preemptions": engine.get_stats().num_preemptions - preemptions_before,
            }
        )
    return points


def knee(points: list[dict[str, Any]], metric: str) -> float | None:
    """The first offered rate whose median `metric` exceeds KNEE_FACTOR x the lightest load's."""
    base = points[0][metric]["median_ms"]
    for point in points[1:]:
        value = point[metric]["median_ms"]
        if base is not None and value is not None and value > KNEE_FACTOR * base:
            return point["request_rate"]
    return None


def plot(points: list[dict[str, Any]], budgets: list[int], path: Path) -> None:
    """TTFT and TPOT (median solid, p99 dotted) against offered load, a line per budget."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for budget in budgets:
        mine = [p for p in points if p["budget"] == budget]
        rates = [p["request_rate"] for p in mine]
        for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
            (line,) = ax.plot(
                rates,
                [p[metric]["median_ms"] for p in mine],
                marker="o",
                label=f"max_num_batched_tokens={budget}",
            )
            ax.plot(rates, [p[metric]["p99_ms"] for p in mine], ls=":", color=line.get_color())
            for p in mine:
                if p["preemptions"]:
                    ax.annotate(
                        f"{p['preemptions']}p",
                        (p["request_rate"], p[metric]["median_ms"]),
                        textcoords="offset points",
                        xytext=(4, 4),
                        fontsize=7,
                    )
    for ax, title in zip(axes, ("TTFT", "TPOT"), strict=True):
        ax.set_title(f"{title}: median (solid), p99 (dotted); Np = N preemptions")
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(args: argparse.Namespace, points: list[dict[str, Any]], capacity: float | None) -> str:
    """The markdown: every point, then where each budget's latency stops being flat."""
    rows = [
        [
            p["budget"],
            fmt(p["request_rate"], 2),
            fmt(p["achieved_rate"], 2),
            fmt(p["output_throughput"]),
            fmt(p["ttft"]["median_ms"]),
            fmt(p["ttft"]["p99_ms"]),
            fmt(p["tpot"]["median_ms"]),
            fmt(p["tpot"]["p99_ms"]),
            p["preemptions"],
        ]
        for p in points
    ]
    knees = []
    for budget in args.budgets:
        mine = [p for p in points if p["budget"] == budget]
        knees.append([budget, fmt(knee(mine, "ttft"), 2), fmt(knee(mine, "tpot"), 2)])
    lines = [
        "# Latency cliff (in-process engine, timed arrivals)",
        "",
        f"{args.num_requests} requests per point, inputs {args.input_len[0]}-{args.input_len[1]},"
        f" outputs {args.output_len[0]}-{args.output_len[1]}, burstiness {args.burstiness:g},"
        f" dtype {args.dtype}, max_num_seqs {args.max_num_seqs}, num_kv_blocks"
        f" {args.num_kv_blocks or 'default'}."
        + (f" Measured capacity: {capacity:.2f} req/s." if capacity else ""),
        "",
        markdown_table(
            [
                "budget",
                "offered req/s",
                "achieved req/s",
                "output tok/s",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "TPOT p50 ms",
                "TPOT p99 ms",
                "preemptions",
            ],
            rows,
        ),
        "",
        f"Where latency stops being flat (first load with median > {KNEE_FACTOR:g}x the"
        " lightest load's; '-' = flat over the sweep):",
        "",
        markdown_table(["budget", "TTFT knee (req/s)", "TPOT knee (req/s)"], knees),
        "",
        f"![latency against load]({args.name}.png)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.loader import load_tokenizer, resolve_model

    tokens = corpus_token_ids(load_tokenizer(resolve_model(args.model)))
    capacity = None
    rates = args.request_rates
    if rates is None:
        capacity = measure_capacity(args, tokens)
        rates = [fraction * capacity for fraction in args.load_fractions]
    rates = sorted(rates)  # the knee is found walking up the load
    points = []
    for budget in args.budgets:
        points += sweep_budget(args, tokens, budget, rates)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plot(points, args.budgets, RESULTS_DIR / f"{args.name}.png")
    payload = {"args": vars(args), "capacity_req_per_s": capacity, "points": points}
    write_results(args.name, payload, report(args, points, capacity))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
