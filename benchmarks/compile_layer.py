"""torch.compile as a candidate for the decode step: one decoder layer, side by side in one run.

One decoder layer of the model (its own weights, dtype `auto`) runs a decode step of
`--batch-sizes` requests, each with `--context` tokens already cached, four ways:

- `torch eager`: the plain torch ops (the `torch` attention backend's model);
- `torch.compile`: the same layer through `torch.compile` (inductor, C++ on the CPU), compiled
  once per batch size before timing (its compile time is reported);
- `kvrail C eager`: the `cpu` backend's model: C kernels launched one by one from Python;
- `kvrail C graph`: the same kernels recorded once (`cpu_runtime.capture`) and replayed.

    python -m benchmarks.compile_layer --batch-sizes 1,16,64
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.common import fmt, markdown_table, write_results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    add("--batch-sizes", default="1,16,64", help="decode requests per step")
    add("--context", type=int, default=256, help="cached tokens per request")
    add("--quantization", default=None, help="e.g. int8, for the kvrail C rows")
    add("--seconds", type=float, default=2.0, help="timing per measurement")
    add("--name", default="compile_layer")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    return args


def decode_step(layer: Any, batch: int, context: int, block_size: int, model: Any) -> tuple:
    """Inputs of one layer for `batch` decode tokens over `context` cached tokens each: the
    hidden states, residual, rope function, and the attention metadata (bound KV cache)."""
    import torch

    from engine.attention import CommonAttentionMetadata

    attn = layer.self_attn
    blocks_per_req = -(-(context + 1) // block_size)
    spec = model.get_kv_cache_spec()
    k_cache, v_cache = spec.allocate(batch * blocks_per_req, block_size, "cpu")[0]
    k_cache.normal_(), v_cache.normal_()
    attn.k_cache, attn.v_cache = k_cache, v_cache
    block_table = torch.arange(batch * blocks_per_req, dtype=torch.int32).view(batch, -1)
    positions = torch.full((batch,), context, dtype=torch.int64)
    slots = block_table[:, context // block_size].long() * block_size + context % block_size
    seq_lens = torch.full((batch,), context + 1, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens,
        block_table=block_table,
        slot_mapping=slots,
        num_reqs=batch,
        num_actual_tokens=batch,
        max_query_len=1,
        block_size=block_size,
    )
    hidden = torch.randn(batch, model.config.hidden_size).to(model.model.dtype)
    residual = torch.randn_like(hidden)
    rope = model.model.rotary_emb.for_step(positions, hidden.dtype)
    return hidden, residual, rope, common


def timed(fn, seconds: float) -> float:
    """Seconds per call, after two warm-up calls."""
    fn(), fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from engine import LLM
    from engine.attention import set_forward_context
    from engine.kernels.cpu_runtime import capture

    results: dict[str, dict[int, float]] = {}
    compile_s: dict[int, float] = {}
    for backend in ("torch", "cpu"):
        kwargs = {"quantization": args.quantization} if backend == "cpu" else {}
        llm = LLM(args.model, attention_backend=backend, enforce_eager=True, **kwargs)
        runner = llm.llm_engine.engine_core.model_runner
        model, layer = runner.model, runner.model.model.layers[0]
        for batch in args.batch_sizes:
            hidden, residual, rope, common = decode_step(
                layer, batch, args.context, runner.block_size, model
            )
            metadata = runner.attn_backend.build(common)

            def step(fn=layer, h=hidden, r=residual, rope=rope, m=metadata):
                with torch.inference_mode(), set_forward_context(m):
                    return fn(h, r, rope)

            if backend == "torch":
                results.setdefault("torch eager", {})[batch] = timed(step, args.seconds)
                compiled = torch.compile(layer, dynamic=False)
                start = time.perf_counter()
                step(compiled)
                compile_s[batch] = time.perf_counter() - start
                results.setdefault("torch.compile", {})[batch] = timed(
                    lambda c=compiled: step(c), args.seconds
                )
                torch._dynamo.reset()
                continue
            results.setdefault("kvrail C eager", {})[batch] = timed(step, args.seconds)
            try:
                with torch.inference_mode(), set_forward_context(metadata), capture() as graph:
                    layer(hidden, residual, rope)
            except RuntimeError:  # unquantized above cpu_float_kernel_max_tokens: torch's mm
                continue
            results.setdefault("kvrail C graph", {})[batch] = timed(graph.replay, args.seconds)
        del llm
    base = results["torch eager"]
    rows = [
        [
            name,
            *(
                f"{fmt(per[b] * 1e3, 3)} ({base[b] / per[b]:.2f}x)" if b in per else "n/a"
                for b in args.batch_sizes
            ),
        ]
        for name, per in results.items()
    ]
    lines = [
        "# One decoder layer, one decode step: torch eager, torch.compile, kvrail's C kernels",
        "",
        f"Layer 0 of the model, default dtype; each request has {args.context} cached tokens."
        f" ms per layer call (speed-up over torch eager); {torch.get_num_threads()} threads."
        f" kvrail C rows: weights {args.quantization or 'unquantized'} (n/a: a graph records C"
        " kernels only, and unquantized steps of more than cpu_float_kernel_max_tokens tokens"
        " use torch's matmul).",
        "",
        markdown_table(["", *(f"batch {b}" for b in args.batch_sizes)], rows),
        "",
        "torch.compile's first call (tracing and compiling, per batch size): "
        + ", ".join(f"batch {b}: {s:.1f} s" for b, s in compile_s.items())
        + ".",
    ]
    write_results(args.name, {"args": vars(args), "results": results, "compile_s": compile_s},
                  "\n".join(lines))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
