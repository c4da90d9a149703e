"""Where an engine step spends its time: torch.profiler over the decode-heavy middle of a run.

A seeded workload (the throughput benchmark's) is admitted at once; after `--skip-steps`
steps (prefills done, the batch decoding), `--steps` steps run under torch.profiler. The
table groups the CPU self time of every op into the parts of a step (linear layers, KV cache
gather, attention, norms, rotary, sampling, ...) and lists the top ops.

    python -m benchmarks.profile_step --num-requests 48 --input-len 256:512 --output-len 128
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

from benchmarks.common import (
    corpus_token_ids,
    fmt,
    greedy_params,
    make_workload,
    markdown_table,
    parse_range,
    write_results,
)

# The first matching substring names an op's part of the step.
PARTS = (
    ("linear", ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm")),
    ("attention", ("scaled_dot_product", "flash_attention", "cpu_decode_attention", "_softmax")),
    ("kv gather / write", ("aten::index_select", "aten::index_copy", "aten::index", "gather")),
    ("norm / activation", ("rms_norm", "aten::pow", "aten::rsqrt", "aten::mean", "aten::silu")),
    ("rotary", ("aten::cos", "aten::sin", "rotary", "aten::neg", "aten::cat")),
    ("sampling", ("aten::topk", "aten::sort", "aten::argmax", "aten::multinomial", "softmax")),
)


def part_of(op_name: str) -> str:
    for part, needles in PARTS:
        if any(needle in op_name for needle in needles):
            return part
    return "other ops"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    add("--num-requests", type=int, default=48)
    add("--input-len", type=parse_range, default=(256, 512), help="LOW:HIGH prompt tokens")
    add("--output-len", type=parse_range, default=(128, 128), help="LOW:HIGH output tokens")
    add("--dtype", default="auto")
    add("--skip-steps", type=int, default=40, help="steps before profiling (prefills)")
    add("--steps", type=int, default=20, help="steps profiled")
    add("--seed", type=int, default=0)
    add("--name", default="profile_step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import LLM
    from engine.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model))
    workload = make_workload(
        corpus_token_ids(tokenizer), args.num_requests, args.input_len, args.output_len, args.seed
    )
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.num_requests)
    engine = llm.llm_engine
    for r in workload:
        engine.add_request(r.request_id, r.prompt_token_ids, greedy_params(r.output_len))
    for _ in range(args.skip_steps):
        engine.step()
    stats = engine.get_stats()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step_ms = (time.perf_counter() - start) / args.steps * 1e3
    while engine.has_unfinished_requests():
        engine.step()

    op_ms: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        op_ms[event.key] += event.self_cpu_time_total / 1e3 / args.steps
    part_ms: dict[str, float] = defaultdict(float)
    for op, ms in op_ms.items():
        part_ms[part_of(op)] += ms
    profiled_ms = sum(op_ms.values())
    part_ms["python / glue (wall - ops)"] = max(0.0, step_ms - profiled_ms)
    rows = [
        [part, fmt(ms, 2), f"{ms / step_ms:.0%}"]
        for part, ms in sorted(part_ms.items(), key=lambda p: -p[1])
    ]
    top = sorted(op_ms.items(), key=lambda p: -p[1])[:12]
    dtype = str(engine.engine_core.model_runner.dtype).removeprefix("torch.")
    markdown = "\n".join(
        [
            "# Where a decode step's time goes",
            "",
            f"{args.num_requests} requests decoding (running {stats.num_running_reqs}),"
            f" dtype {dtype}, {torch.get_num_threads()} threads; {args.steps} steps profiled"
            f" after {args.skip_steps}. Wall time per step {step_ms:.1f} ms (under the"
            " profiler, which adds a little per op).",
            "",
            markdown_table(["part", "ms / step", "share"], rows),
            "",
            markdown_table(["top op", "ms / step"], [[op, fmt(ms, 2)] for op, ms in top]),
        ]
    )
    payload: dict[str, Any] = {
        "args": vars(args),
        "step_ms": step_ms,
        "parts_ms": dict(part_ms),
        "ops_ms": dict(top),
    }
    write_results(args.name, payload, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
