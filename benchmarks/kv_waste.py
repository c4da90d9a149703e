"""KV waste: paged allocation against contiguous per-request reservation, same memory, same mix.

No model: kvrail's real `Scheduler` and `KVCacheManager` run the mix with a fake model
runner (one token per decode step, as in tests/engine/test_scheduler.py), and the older
scheme, one contiguous reservation per request of `max_model_len` (or of prompt +
`max_tokens`), is simulated with the same step semantics: a prompt is stored in its first
step, then one token per step, and the last sampled token never needs KV. Memory is measured
during each step's forward. Reported per scheme: the fraction of reserved KV slots holding
real tokens at the peak (the step storing the most tokens) and averaged over steps, and how
many requests ran at once.

    python -m benchmarks.kv_waste --num-requests 128 --kv-tokens 32768
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    markdown_table,
    parse_range,
    sample_lengths,
    verdict,
    write_results,
)

PAGED_TARGET = 0.96  # fraction of paged KV holding real tokens at the peak
# SmolLM2-135M in bf16: K and V x 30 layers x 3 KV heads x 64 dims x 2 bytes.
SMOLLM2_BF16_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2

TABLE_HEADERS = (
    "scheme", "real tokens at peak", "mean over steps", "tokens at peak",
    "slots reserved at peak", "max running", "preemptions", "steps",
)  # fmt: skip

Lengths = Sequence[tuple[int, int]]  # (prompt_len, output_len) per request


@dataclass
class Occupancy:
    """What one scheme held over a run: per step, KV slots reserved and tokens stored."""

    scheme: str
    reserved: list[int]
    stored: list[int]
    running: list[int]
    preemptions: int = 0

    def summary(self) -> dict[str, Any]:
        peak = max(range(len(self.stored)), key=self.stored.__getitem__)
        return {
            "scheme": self.scheme,
            "steps": len(self.stored),
            "peak_stored_tokens": self.stored[peak],
            "reserved_at_peak": self.reserved[peak],
            "utilization_at_peak": self.stored[peak] / self.reserved[peak],
            "mean_utilization": sum(self.stored) / sum(self.reserved),
            "max_running": max(self.running),
            "preemptions": self.preemptions,
        }


def simulate_paged(
    lengths: Lengths, num_blocks: int, block_size: int, max_num_seqs: int
) -> Occupancy:
    """kvrail's scheduler and block manager on the mix, all requests queued at the start."""
    from engine.config import CacheConfig, SchedulerConfig
    from engine.outputs import ModelRunnerOutput
    from engine.request import Request, SamplingParams
    from engine.scheduler import Scheduler

    capacity = num_blocks * block_size
    scheduler = Scheduler(
        # A budget as large as the pool: every prompt is prefilled in one step, as in the
        # contiguous simulation, so the two differ only in how memory is reserved.
        SchedulerConfig(max_num_seqs, max_num_batched_tokens=capacity, max_model_len=capacity),
        CacheConfig(block_size, num_blocks, enable_prefix_caching=False),
    )
    for i, (prompt_len, output_len) in enumerate(lengths):
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", [10] * prompt_len, params, eos_token_id=2))
    occupancy = Occupancy("paged", [], [], [])
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        stats = scheduler.make_stats()  # counters already include this step's tokens
        occupancy.reserved.append(stats.num_blocks_in_use * block_size)
        occupancy.stored.append(stats.num_tokens_stored)
        occupancy.running.append(stats.num_running_reqs)
        # Fake runner: a request samples one token once all its known tokens are computed.
        req_ids = list(output.num_scheduled_tokens)
        sampled = [
            [7]
            if scheduler.requests[r].num_computed_tokens == scheduler.requests[r].num_tokens
            else []
            for r in req_ids
        ]
        scheduler.update_from_output(
            output, ModelRunnerOutput(req_ids, sampled, [[] for _ in req_ids])
        )
    occupancy.preemptions = scheduler.num_preemptions
    return occupancy


def simulate_contiguous(
    lengths: Lengths,
    capacity: int,
    reservation: Callable[[int, int], int],
    max_num_seqs: int,
    scheme: str,
) -> Occupancy:
    """One reservation per request, admitted first come first served while it fits."""
    waiting = list(lengths)
    running: list[list[int]] = []  # [reserved, stored, prompt_len, output_len]
    occupancy = Occupancy(scheme, [], [], [])
    while waiting or running:
        for entry in running:  # decode: one more token's KV
            entry[1] += 1
        while waiting and len(running) < max_num_seqs:
            prompt_len, output_len = waiting[0]
            size = reservation(prompt_len, output_len)
            if size > capacity:
                raise ValueError(f"a reservation of {size} tokens exceeds the {capacity} in all")
            if sum(e[0] for e in running) + size > capacity:
                break
            waiting.pop(0)
            running.append([size, prompt_len, prompt_len, output_len])  # prefill
        occupancy.reserved.append(sum(e[0] for e in running))
        occupancy.stored.append(sum(e[1] for e in running))
        occupancy.running.append(len(running))
        # A request has sampled its last token once it stored prompt + output - 1 tokens.
        running = [e for e in running if e[1] < e[2] + e[3] - 1]
    return occupancy


def compare(lengths: Lengths, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The three schemes on the same mix and the same number of KV slots."""
    capacity = args.num_blocks * args.block_size
    max_model_len = args.max_model_len
    return [
        simulate_paged(lengths, args.num_blocks, args.block_size, args.max_num_seqs).summary(),
        simulate_contiguous(
            lengths,
            capacity,
            lambda p, o: p + o,
            args.max_num_seqs,
            "contiguous, prompt+max_tokens",
        ).summary(),
        simulate_contiguous(
            lengths,
            capacity,
            lambda p, o: max_model_len,
            args.max_num_seqs,
            f"contiguous, max_model_len={max_model_len}",
        ).summary(),
    ]


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    """Bars: KV holding real tokens (at peak, mean) and requests running at once, per scheme."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    names = [s["scheme"].replace(", ", "\n") for s in summaries]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(summaries))
    left.bar(
        [i - 0.2 for i in x],
        [100 * s["utilization_at_peak"] for s in summaries],
        0.4,
        label="at peak",
    )
    left.bar(
        [i + 0.2 for i in x],
        [100 * s["mean_utilization"] for s in summaries],
        0.4,
        label="mean over steps",
    )
    left.set_ylabel("% of reserved KV holding real tokens")
    left.set_ylim(0, 105)
    left.legend(fontsize=8)
    right.bar(list(x), [s["max_running"] for s in summaries], 0.5, color="tab:green")
    right.set_ylabel("requests running at once (max)")
    for ax in (left, right):
        ax.set_xticks(list(x), names, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Same request mix, same KV memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(args: argparse.Namespace, summaries: list[dict[str, Any]]) -> str:
    """The markdown table and the paged scheme's verdict."""
    capacity = args.num_blocks * args.block_size
    mib = capacity * args.bytes_per_token / 2**20
    rows = [
        [
            s["scheme"],
            f"{s['utilization_at_peak']:.1%}",
            f"{s['mean_utilization']:.1%}",
            s["peak_stored_tokens"],
            s["reserved_at_peak"],
            s["max_running"],
            s["preemptions"],
            s["steps"],
        ]
        for s in summaries
    ]
    setup = (
        f"{args.num_requests} requests (inputs {args.input_len[0]}-{args.input_len[1]},"
        f" outputs {args.output_len[0]}-{args.output_len[1]}, seed {args.seed}), all queued at"
        f" once; {capacity} KV slots ({args.num_blocks} blocks of {args.block_size}, {mib:,.0f}"
        f" MiB at {args.bytes_per_token} B/token), max_num_seqs {args.max_num_seqs}."
    )
    paged = summaries[0]["utilization_at_peak"]
    lines = [
        "# KV waste: paged against contiguous reservation",
        "",
        setup,
        "",
        markdown_table(TABLE_HEADERS, rows),
        "",
        f"Paged KV holding real tokens at peak: {paged:.1%} (target >= {PAGED_TARGET:.0%}):"
        f" {verdict(paged, PAGED_TARGET)}.",
        "",
        f"![KV waste]({args.name}.png)",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--num-requests", type=int, default=128)
    add("--input-len", type=parse_range, default=(64, 512))
    add("--output-len", type=parse_range, default=(64, 256))
    add("--seed", type=int, default=0)
    add("--num-blocks", type=int, default=2048, help="KV pool size in blocks")
    add("--block-size", type=int, default=16)
    add(
        "--max-model-len",
        type=int,
        default=8192,
        help="SmolLM2's context, as older servers reserve",
    )
    add("--max-num-seqs", type=int, default=1024)
    add("--bytes-per-token", type=int, default=SMOLLM2_BF16_BYTES_PER_TOKEN)
    add("--name", default="kv_waste")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lengths = sample_lengths(args.num_requests, args.input_len, args.output_len, args.seed)
    summaries = compare(lengths, args)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plot(summaries, RESULTS_DIR / f"{args.name}.png")
    write_results(args.name, {"args": vars(args), "schemes": summaries}, report(args, summaries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
