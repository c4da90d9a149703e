"""Where an engine step spends its time: torch.profiler over the decode-heavy middle of a run.

A seeded workload (the throughput benchmark's) is admitted at once; after `--skip-steps`
steps (prefills done, the batch decoding), `--steps` steps run under torch.profiler, once per
attention backend, side by side in one run. The table groups the CPU self time of every op
into the parts of a step (linear layers, KV cache gather, attention, norms, rotary,
sampling, ...) and lists the top ops.

    python -m benchmarks.profile_step --attention-backends torch,cpu
"""

from __future__ import annotations

import argparse
import json
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
    ("decode graph (all its C kernels)", ("kvrail::cpu_graph",)),
    ("linear", ("aten::addmm", "aten::mm", "aten::matmul", "kvrail_linear", "quantize_rows")),
    ("attention", ("scaled_dot_product", "flash_attention", "_attention", "_softmax")),
    ("kv gather / write", ("aten::index_select", "aten::index_copy", "aten::index", "write_kv")),
    ("norm / activation", ("rms_norm", "aten::pow", "aten::rsqrt", "aten::mean", "silu")),
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
    add("--quantization", default=None, help="e.g. int8")
    add("--kv-cache-dtype", default="auto", help="auto, bfloat16 (float32 models) or fp8")
    add("--enforce-eager", action="store_true", help="no decode graphs")
    add("--speculative-config", type=json.loads, default=None, help="JSON, as vLLM's")
    add("--attention-backends", default="torch,cpu", help="comma list, profiled in turn")
    add("--skip-steps", type=int, default=40, help="steps before profiling (prefills)")
    add("--steps", type=int, default=20, help="steps profiled")
    add("--seed", type=int, default=0)
    add("--name", default="profile_step")
    return parser.parse_args(argv)


def profile_backend(args: argparse.Namespace, workload: list, backend: str) -> dict[str, Any]:
    """Run the workload on one attention backend; profile `--steps` decode-heavy steps."""
    from torch.profiler import ProfilerActivity, profile

    from engine import LLM

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.enforce_eager,
        speculative_config=args.speculative_config,
        max_num_seqs=args.num_requests,
        attention_backend=backend,
    )
    engine = llm.llm_engine
    for r in workload:
        engine.add_request(r.request_id, r.prompt_token_ids, greedy_params(r.output_len))
    for _ in range(args.skip_steps):
        engine.step()
    num_running = engine.get_stats().num_running_reqs
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
    part_ms["python / glue (wall - ops)"] = max(0.0, step_ms - sum(op_ms.values()))
    runner = engine.engine_core.model_runner
    return {
        "backend": runner.attn_backend.name,
        "dtype": ", ".join(
            filter(
                None,
                (
                    args.quantization,
                    str(runner.dtype).removeprefix("torch."),
                    None if args.kv_cache_dtype == "auto" else f"{args.kv_cache_dtype} kv",
                ),
            )
        ),
        "num_running": num_running,
        "step_ms": step_ms,
        "parts_ms": dict(part_ms),
        "top_ops_ms": dict(sorted(op_ms.items(), key=lambda p: -p[1])[:8]),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from engine.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model))
    workload = make_workload(
        corpus_token_ids(tokenizer), args.num_requests, args.input_len, args.output_len, args.seed
    )
    runs = [profile_backend(args, workload, b) for b in args.attention_backends.split(",")]
    parts = sorted(
        {p for run in runs for p in run["parts_ms"]}, key=lambda p: -runs[0]["parts_ms"].get(p, 0)
    )
    rows = [[part, *(fmt(run["parts_ms"].get(part, 0.0), 1) for run in runs)] for part in parts]
    rows.append(["**wall time per step**", *(f"**{fmt(run['step_ms'], 1)}**" for run in runs)])
    headers = ["ms per step", *(f"{run['backend']} ({run['dtype']})" for run in runs)]
    lines = [
        "# Where a decode step's time goes",
        "",
        f"{args.num_requests} requests admitted at once (inputs {args.input_len[0]}-"
        f"{args.input_len[1]}, outputs {args.output_len[0]}-{args.output_len[1]} tokens);"
        f" {args.steps} steps profiled after {args.skip_steps}, with"
        f" {runs[0]['num_running']} requests decoding; {torch.get_num_threads()} threads."
        " torch.profiler self time per op, grouped; it adds a little per op.",
        "",
        markdown_table(headers, rows),
    ]
    if len(runs) > 1:
        base = runs[0]
        for run in runs[1:]:
            lines.append(
                f"\nStep time {run['backend']} / {base['backend']}:"
                f" {run['step_ms'] / base['step_ms']:.2f}"
                f" ({base['step_ms'] / run['step_ms']:.2f}x faster)."
            )
    for run in runs:
        top = [[op, fmt(ms, 2)] for op, ms in run["top_ops_ms"].items()]
        lines += ["", markdown_table([f"top ops, {run['backend']}", "ms / step"], top)]
    write_results(args.name, {"args": vars(args), "runs": runs}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
