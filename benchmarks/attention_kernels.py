"""The CPU's attention kernels on the shapes a step gives them, one layer at a time.

The `cpu` backend sends every step's queries to one of two C kernels: up to
`MAX_DECODE_QUERY_LEN` query tokens per sequence (decodes, speculative verify steps of 1 + k
queries) to the decode kernel, anything longer (prompts, prompt chunks over cached context) to
the prompt kernel; verify steps are timed on both, and prompts on torch's dense SDPA too, as a
yardstick. This times them on the default model's head layout over a paged cache of random
blocks, the cases taking turns within each round, and reports the median time per layer and
the arithmetic rate (QK^T and PV, causal: only the scores a query attends to). Each turn
calls its case `--repeats` times after one untimed call, so the case's cache and queries sit
in the CPU's caches: like `linear_kernels.py` this times the kernels, not DRAM (a case run
right after the 4 x 512 prompts, cold, took 2-5x longer on a 2-vCPU AVX2 EPYC). The one
exception is a batch of `--batch-size` decodes, a full batch's decode step: its cache (78 MB
in fp32 for 128 x 400 tokens) is larger than the CPU's caches, so it reads DRAM as the
engine's step does. Decode steps are timed over an fp8 cache too.

    python -m benchmarks.attention_kernels --context-len 400 --verify-queries 5,8
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import time
from typing import Any

from benchmarks.common import fmt, markdown_table, write_results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    add("--dtype", default="auto", help="float32, bfloat16 or auto (the engine's choice)")
    add("--prompt-lens", default="128,512", help="prompts of these lengths, 4 at a time")
    add("--context-len", type=int, default=400, help="cached tokens of a decode / verify step")
    add("--verify-queries", default="5,8", help="query tokens of verify steps (1 + k)")
    add("--batch-size", type=int, default=128, help="sequences of the batched decode step")
    add("--block-size", type=int, default=16)
    add("--rounds", type=int, default=10)
    add("--repeats", type=int, default=10, help="calls of a case in a row, each round")
    add("--name", default="attention_kernels")
    args = parser.parse_args(argv)
    args.prompt_lens = [int(n) for n in args.prompt_lens.split(",") if n]
    args.verify_queries = [int(n) for n in args.verify_queries.split(",") if n]
    return args


def make_case(
    torch: Any,
    heads: tuple[int, int, int],
    dtype: Any,
    block_size: int,
    q_lens: list[int],
    seq_lens: list[int],
    fp8: bool = False,
) -> dict[str, Any]:
    """Tensors of one step: requests with `q_lens` queries over `seq_lens` cached tokens, the
    cache in q's dtype or fp8 e4m3 (scales of 1)."""
    num_heads, num_kv_heads, head_dim = heads
    blocks_each = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_each)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    table = torch.randperm(num_blocks, dtype=torch.int32)  # blocks anywhere in the pool
    block_table = torch.zeros(len(seq_lens), max(blocks_each), dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks_each):
        block_table[r, :n] = table[start : start + n]
        start += n
    num_tokens = sum(q_lens)
    starts = [0, *itertools.accumulate(q_lens)]
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    return dict(
        q=torch.randn(num_tokens, num_heads, head_dim).to(dtype),
        k_cache=torch.randn(cache_shape).to(cache_dtype),
        v_cache=torch.randn(cache_shape).to(cache_dtype),
        block_table=block_table,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        req_indices=torch.arange(len(seq_lens), dtype=torch.int32),
        scale=head_dim**-0.5,
        out=torch.empty(num_tokens, num_heads, head_dim, dtype=dtype),
    )


def dense_sdpa(query: Any, key: Any, value: Any) -> Any:
    """torch's causal SDPA over `[4, heads, n, head_dim]` tensors, kv heads shared (GQA)."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)


def attended_flop(heads: tuple[int, int, int], q_lens: list[int], seq_lens: list[int]) -> float:
    """QK^T and PV over the keys each query sees (causal), 2 flop a multiply-add."""
    num_heads, _, head_dim = heads
    pairs = sum(sum(s - q + i + 1 for i in range(q)) for q, s in zip(q_lens, seq_lens, strict=True))
    return 2 * 2 * pairs * num_heads * head_dim


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoConfig

    from engine import resolve_model
    from engine.kernels.cpu_attention import paged_decode_attention, paged_prefill_attention
    from engine.model_runner import resolve_dtype

    config = AutoConfig.from_pretrained(resolve_model(args.model))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = (config.num_attention_heads, config.num_key_value_heads, head_dim)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    torch.manual_seed(0)
    n, batch = args.context_len, args.batch_size
    shapes = [(f"prompts 4 x {p}", "prompt", [p] * 4, [p] * 4, False) for p in args.prompt_lens]
    for fp8, cache in ((False, ""), (True, ", fp8 cache")):
        shapes.append((f"decode, {n} cached{cache}", "decode", [1], [n], fp8))
        shapes.append((f"decode {batch} x {n} cached (DRAM){cache}", "decode", [1] * batch,
                       [n] * batch, fp8))  # fmt: skip
    shapes += [
        (f"verify {q} queries, {n} cached", kernel, [q], [n], False)
        for q in args.verify_queries
        for kernel in ("decode", "prompt")
    ]
    kernels = {"prompt": paged_prefill_attention, "decode": paged_decode_attention}
    cases = [
        (label, kernels[kernel], make_case(torch, heads, dtype, args.block_size, q, s, fp8),
         attended_flop(heads, q, s))
        for label, kernel, q, s, fp8 in shapes
    ]  # fmt: skip
    # torch's SDPA on the same prompts, dense and contiguous (what a fresh prompt's own q, k
    # and v could go through without the paged cache): a yardstick for the prompt kernel.
    for n in args.prompt_lens:
        dense = {
            name: torch.randn(4, h, n, heads[2]).to(dtype)
            for name, h in (("query", heads[0]), ("key", heads[1]), ("value", heads[1]))
        }
        flop = attended_flop(heads, [n] * 4, [n] * 4)
        cases.append((f"prompts 4 x {n}", dense_sdpa, dense, flop))
    times: dict[tuple[str, str], list[float]] = {(c[0], c[1].__name__): [] for c in cases}
    for _, kernel, tensors, _ in cases:  # warm-up
        kernel(**tensors)
    for _ in range(args.rounds):
        for label, kernel, tensors, _ in cases:
            kernel(**tensors)  # this case's tensors back in cache after the others'
            start = time.perf_counter()
            for _ in range(args.repeats):
                kernel(**tensors)
            times[label, kernel.__name__].append((time.perf_counter() - start) / args.repeats)
    results = []
    for label, kernel, _, flop in cases:
        seconds = statistics.median(times[label, kernel.__name__])
        results.append(
            dict(case=label, kernel=kernel.__name__, us=1e6 * seconds, gflops=flop / seconds / 1e9)
        )
    rows = [[r["case"], r["kernel"], fmt(r["us"], 1), fmt(r["gflops"], 1)] for r in results]
    markdown = "\n\n".join(
        [
            "# Attention kernels on the CPU, one layer",
            f"{heads[0]} query and {heads[1]} kv heads of {heads[2]}, {dtype} queries and "
            f"cache, blocks of {args.block_size} in random order, {torch.get_num_threads()} "
            f"threads, {platform.machine()}; medians of {args.rounds} rounds of "
            f"{args.repeats} calls in a row (cache-resident but for the batch of "
            f"{batch}), the cases taking turns. "
            "GFLOP/s: QK^T and PV over the keys each query attends to.",
            markdown_table(["case", "kernel", "us", "GFLOP/s"], rows),
        ]
    )
    write_results(args.name, dict(args=vars(args), dtype=str(dtype), results=results), markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
