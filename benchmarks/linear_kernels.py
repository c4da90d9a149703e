"""The CPU's linear layers side by side: torch's matmul, kvrail's C float, packed bf16 and
W8A8 kernels.

Unquantized steps of at most `engine.models.layers.cpu_float_kernel_max_tokens` tokens run the
C float kernel (and can then be recorded into a CPU graph); larger ones run torch's matmul
(oneDNN). In bf16 on an AVX512-BF16 CPU (with AMX or not), the packed bf16 kernel runs every
step instead (`C packed bf16`, timed there in place of `C float`).
`quantization="int8"` runs the C W8A8 kernel at every size. This times one forward
pass's worth of the model's linear layers (the engine's fused shapes: qkv, o, gate_up, down
per layer, then the LM head) each way at each `--num-tokens`, alternating the systems within
each round, and reports the medians and their ratios to torch's matmul. `torch _int_mm` is a
yardstick for the C int8 kernel: oneDNN's int8 x int8 -> int32 product alone, on activations
quantized beforehand and with no scales applied to its sums (the C kernel's time includes
both).

By default each shape's weights are one matrix run `count` times, so most of them stay in the
caches: the kernels' arithmetic. `--per-layer-weights` gives every layer a matrix of its own
(270 MB in bf16 for SmolLM2-135M), read from DRAM on every pass as the engine reads them.

`--baseline-ref REF` builds the kernel library of git ref REF (in a worktree) and times each C
kernel with it too, in the same rounds (`cpu_runtime.kernel_library`): the before of a
before/after, free of the drift between two runs on a shared machine. REF's kernels read this
checkout's packed weights, so a change to the packing cannot be compared this way.

`--graph` records each C kernel's pass into a CPU graph once and times its replays, as the
engine's decode steps run them (`engine/decode_graphs.py`): one OpenMP team for the whole
pass, each kernel starting as the one before ends, where a launch of its own wakes the team
and leaves DRAM idle in between. torch's systems, which a graph cannot record, run as before.

    python -m benchmarks.linear_kernels --num-tokens 1,2,4,8,16,32,64,256
    python -m benchmarks.linear_kernels --per-layer-weights --num-tokens 1,8,16,32,64,96,128
    python -m benchmarks.linear_kernels --num-tokens 6,128,2048 --baseline-ref HEAD
    python -m benchmarks.linear_kernels --per-layer-weights --graph --num-tokens 1,6,128

`--logits` times the LM head instead, as a decode step runs it: the C kernel's product (packed
bf16 with float32 logits where the CPU packs bf16, W8A8 with logits in the activations' dtype)
and the greedy argmax over it, after 64 MB of other memory has been written (what the step's
weights and KV cache do to the caches), with the logits stored as usual and streamed around the
caches (`stream_out`, `cpu_linear.c` STREAM_OUT) in turn: what `Linear.streams_out`'s limit
rests on.

    python -m benchmarks.linear_kernels --logits --num-tokens 1,4,8,16,32,64,128,256
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import fmt, markdown_table, write_results
from benchmarks.engine_process import baseline_library, git_ref

SYSTEMS = ("torch matmul", "C float", "C packed bf16", "C int8", "torch _int_mm")
C_KERNELS = ("C float", "C packed bf16", "C int8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    add("--num-tokens", default="1,2,4,8,16,32,64,256", help="rows per matmul (M)")
    add("--dtype", default="auto", help="float32, bfloat16 or auto (the engine's choice)")
    add("--rounds", type=int, default=5)
    add("--per-layer-weights", action="store_true", help="a matrix per layer (read from DRAM)")
    add("--graph", action="store_true", help="C kernels replayed as one CPU graph per pass")
    add("--baseline-ref", type=git_ref, default=None,
        help="also time the C kernels of this git ref's library")  # fmt: skip
    add("--logits", action="store_true", help="the LM head and its argmax, streamed or not")
    add("--name", default="linear_kernels")
    args = parser.parse_args(argv)
    if args.logits and (args.per_layer_weights or args.graph or args.baseline_ref):
        parser.error("--logits takes none of --per-layer-weights, --graph, --baseline-ref")
    args.num_tokens = [int(m) for m in args.num_tokens.split(",")]
    return args


def engine_shapes(config: Any) -> list[tuple[int, int, int]]:
    """(in, out, count) of the engine's fused linear layers in one forward pass."""
    from engine.models.llama import head_dim_of

    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = head_dim_of(config)
    q_out = config.num_attention_heads * head_dim
    kv_out = config.num_key_value_heads * head_dim
    layers = config.num_hidden_layers
    return [
        (hidden, q_out + 2 * kv_out, layers),  # qkv
        (q_out, hidden, layers),  # o
        (hidden, 2 * inter, layers),  # gate_up
        (inter, hidden, layers),  # down
        (hidden, config.vocab_size, 1),  # LM head
    ]


def forward_pass(
    run: Any,
    work: list[tuple[Any, list[dict[str, Any]], int]],
    system: str,
    library: Any,
    graph: bool,
) -> Callable[[], None]:
    """What runs one forward pass's linear layers: each shape `count` times, over its matrices
    in turn (one, or one per layer); C kernels from `library` (None: this checkout's), and
    with `graph` recorded here once (which runs them) and replayed."""
    from engine.kernels.cpu_runtime import capture, kernel_library

    def run_pass() -> None:
        with kernel_library(library):
            for x, weights, count in work:
                for i in range(count):
                    run(x, weights[i % len(weights)][system])

    if not graph:
        return run_pass
    with capture() as recorded:
        run_pass()
    return recorded.replay


def time_pass(run_pass: Callable[[], None]) -> float:
    """Seconds of one call of `run_pass`."""
    start = time.perf_counter()
    run_pass()
    return time.perf_counter() - start


def logits_main(args: argparse.Namespace) -> int:
    """`--logits`: see the module docstring."""
    import torch
    from transformers import AutoConfig

    from engine import resolve_model
    from engine.kernels.cpu_linear import linear_bf16_packed, linear_w8a8, pack_bf16, pack_int8
    from engine.kernels.cpu_ops import argmax_rows
    from engine.kernels.int8_ref import quantize_rows_int8
    from engine.model_runner import resolve_dtype
    from engine.models.layers import packs_bf16

    config = AutoConfig.from_pretrained(resolve_model(args.model))
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    n_in, n_out, _ = engine_shapes(config)[-1]
    w = torch.randn(n_out, n_in, dtype=dtype) * n_in**-0.5
    heads = {"C int8": (linear_w8a8, pack_int8(*quantize_rows_int8(w), None, False))}
    if packs_bf16(dtype):
        packed = pack_bf16(w, None, False)
        heads["C packed bf16"] = (
            lambda x, head, stream: linear_bf16_packed(x, head, torch.float32, stream),
            packed,
        )
    other = torch.zeros(64 << 20 >> 2)

    def step(x: torch.Tensor, linear: Callable, head: Any, stream: bool) -> float:
        other.add_(1.0)
        start = time.perf_counter()
        argmax_rows(linear(x, head, stream))
        return time.perf_counter() - start

    results, rows = [], []
    with torch.inference_mode():
        for num_tokens in args.num_tokens:
            x = torch.randn(num_tokens, n_in, dtype=dtype)
            times: dict[str, list[float]] = {}
            for _ in range(args.rounds + 1):  # the first round warms up
                for name, (linear, head) in heads.items():
                    for stream in (False, True):
                        times.setdefault(f"{name}{' streamed' * stream}", []).append(
                            step(x, linear, head, stream)
                        )
            ms = {label: 1e3 * statistics.median(t[1:]) for label, t in times.items()}
            results.append(dict(num_tokens=num_tokens, ms=ms))
            rows.append(
                [num_tokens]
                + [fmt(ms[label], 3) for label in times]
                + [fmt(ms[f"{name} streamed"] / ms[name], 2) for name in heads]
            )
    headers = [
        "tokens (M)",
        *(f"{label} ms" for label in times),
        *(f"{name}: streamed / stored" for name in heads),
    ]
    markdown = "\n\n".join(
        [
            "# The LM head and its argmax: logits stored or streamed",
            f"{n_out} x {n_in}, activations in {dtype}, 64 MB written before each, "
            f"{torch.get_num_threads()} threads, {platform.machine()}; medians of "
            f"{args.rounds} rounds, the systems alternating.",
            markdown_table(headers, rows),
        ]
    )
    write_results(args.name, dict(args=vars(args), dtype=str(dtype), results=results), markdown)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.logits:
        return logits_main(args)
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig

    from engine import resolve_model
    from engine.kernels.cpu_linear import (
        linear_bf16_packed,
        linear_float,
        linear_w8a8,
        pack_bf16,
        pack_int8,
    )
    from engine.kernels.int8_ref import quantize_rows_int8
    from engine.model_runner import resolve_dtype
    from engine.models.layers import packs_bf16

    config = AutoConfig.from_pretrained(resolve_model(args.model))
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    float_kernel = lambda x, w: linear_float(x, w, None)  # noqa: E731
    int_mm = lambda x, w: torch._int_mm(w[0], w[1])  # noqa: E731  (x: only its shape counts)
    runs = dict(
        zip(SYSTEMS, (F.linear, float_kernel, linear_bf16_packed, linear_w8a8, int_mm), strict=True)
    )
    packed_bf16 = packs_bf16(dtype)
    # The C kernel the engine runs for unquantized steps: packed bf16 or float, never both.
    systems = [name for name in SYSTEMS if name != ("C float" if packed_bf16 else "C packed bf16")]
    # (label, system, library: None for this checkout's), the baseline's right after each C kernel
    ref = args.baseline_ref
    base = baseline_library(ref) if ref is not None else None
    baselined = [name for name in systems if name in C_KERNELS and base is not None]
    timed = [
        entry
        for name in systems
        for entry in [(name, name, None)] + [(f"{name} @ {ref}", name, base)] * (name in baselined)
    ]

    def matrices(n_in: int, n_out: int) -> dict[str, Any]:
        w = torch.randn(n_out, n_in, dtype=dtype) * n_in**-0.5
        w_q, w_scale = quantize_rows_int8(w)
        return {
            "torch matmul": w,
            "C float": w,
            "C packed bf16": pack_bf16(w, None, False) if packed_bf16 else None,
            "C int8": pack_int8(w_q, w_scale, None, False),
            "torch _int_mm": w_q.t().contiguous(),
        }

    weights = [
        ([matrices(n_in, n_out) for _ in range(count if args.per_layer_weights else 1)], count)
        for n_in, n_out, count in engine_shapes(config)
    ]
    results = []
    with torch.inference_mode():
        for num_tokens in args.num_tokens:
            work = []
            for ws, count in weights:
                x = torch.randn(num_tokens, ws[0]["C float"].shape[1], dtype=dtype)
                x_q = torch.randint(-127, 128, x.shape, dtype=torch.int8)
                ws = [{**w, "torch _int_mm": (x_q, w["torch _int_mm"])} for w in ws]
                work.append((x, ws, count))
            times: dict[str, list[float]] = {label: [] for label, *_ in timed}
            passes = {
                label: forward_pass(
                    runs[name], work, name, library, args.graph and name in C_KERNELS
                )
                for label, name, library in timed
            }
            for run_pass in passes.values():  # warm-up: first calls pick kernels
                run_pass()
            for _ in range(args.rounds):
                for label, run_pass in passes.items():
                    times[label].append(time_pass(run_pass))
            ms = {label: 1e3 * statistics.median(t) for label, t in times.items()}
            results.append(dict(num_tokens=num_tokens, ms=ms))
    labels = [label for label, *_ in timed]
    rows = [
        [r["num_tokens"]]
        + [fmt(r["ms"][label], 2) for label in labels]
        + [fmt(r["ms"][name] / r["ms"]["torch matmul"], 2) for name in systems[1:]]
        + [fmt(r["ms"][name] / r["ms"][f"{name} @ {ref}"], 2) for name in baselined]
        for r in results
    ]
    headers = [
        "tokens (M)",
        *(f"{label} ms" for label in labels),
        *(f"{name} / torch" for name in systems[1:]),
        *(f"{name} / {name} @ {ref}" for name in baselined),
    ]
    num_matmuls = sum(count for *_, count in engine_shapes(config))
    markdown = "\n\n".join(
        [
            f"# Linear layers on the CPU: {', '.join(labels)}",
            f"One forward pass's linear layers ({num_matmuls} matmuls, the engine's fused "
            f"shapes; {'a matrix per layer' if args.per_layer_weights else 'a matrix per shape'}"
            f"{'; C kernels replayed as one CPU graph a pass' if args.graph else ''}"
            f"), activations in {dtype}, {torch.get_num_threads()} threads, "
            f"{platform.machine()}; medians of {args.rounds} rounds, the systems alternating"
            + (f"; `@ {ref}`: the C kernels of git ref {ref}'s library." if ref else "."),
            markdown_table(headers, rows),
        ]
    )
    payload = dict(args=vars(args), dtype=str(dtype), results=results)
    write_results(args.name, payload, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
