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
exception is a batch of `--batch-size` decodes, a full batch's decode step: it runs over
`--layers` layers, each with a cache of its own (for 128 x 400 tokens, 39 MB a layer in bf16:
one layer would still sit partly in a 32 MB L3 from call to call), so it reads DRAM as the
engine's step does; its GB/s counts the K and V bytes read. Decode steps are timed over an
fp8 cache too.

`--baseline-ref REF` builds the kernel library of git ref REF (in a worktree) and times
every paged case on it too, in the same process, the two libraries taking turns: the before
of a before/after, free of the drift between two runs on a shared machine.

    python -m benchmarks.attention_kernels --context-len 400 --verify-queries 5,8
    python -m benchmarks.attention_kernels --baseline-ref HEAD~1 --name attention_kernels-ab
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import time
from typing import Any

from benchmarks.common import fmt, markdown_table, write_results
from benchmarks.engine_process import baseline_library, git_ref


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
    add("--layers", type=int, default=8, help="layers of the batched decode step, from DRAM")
    add("--block-size", type=int, default=16)
    add("--rounds", type=int, default=10)
    add("--repeats", type=int, default=10, help="calls of a case in a row, each round")
    add("--engine-batch", type=int, default=0,
        help="also replay one decode step of an int8 engine serving this many requests of the "
             "full workload, over its own cache (0: off)")  # fmt: skip
    add(
        "--baseline-ref",
        type=git_ref,
        default=None,
        help="git ref whose kernel library is timed too",
    )
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


def kv_bytes(tensors: dict[str, Any]) -> int:
    """K and V bytes a decode step reads: every sequence's context, once."""
    k_cache = tensors["k_cache"]
    row = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    return 2 * row * int(tensors["seq_lens"].sum())


def engine_step_layers(model: str | None, num_requests: int) -> list[dict[str, Any]]:
    """The decode kernel's calls, one a layer, of one step of an engine (int8 weights) serving
    `num_requests` requests of the full workload admitted at once, 40 steps in (the prompts
    done): its own cache (the tensors outlive the engine), block tables and context lengths.
    Eager: a decode graph's replay launches the kernel without the Python call recorded here."""
    from benchmarks.common import (
        FULL_WORKLOAD_KV_BYTES,
        corpus_token_ids,
        greedy_params,
        make_workload,
    )
    from engine import LLM
    from engine.kernels import cpu_attention

    # With fewer blocks some requests are preempted by step 40, and a step of fewer decodes is
    # not the workload's.
    llm = LLM(model=model, quantization="int8", enforce_eager=True, max_num_seqs=num_requests,
              kv_cache_memory_bytes=FULL_WORKLOAD_KV_BYTES)  # fmt: skip
    workload = make_workload(
        corpus_token_ids(llm.get_tokenizer()), num_requests, (64, 512), (64, 256), seed=0
    )
    engine = llm.llm_engine
    for r in workload:
        engine.add_request(r.request_id, r.prompt_token_ids, greedy_params(r.output_len))
    for _ in range(40):
        engine.step()
    layers = []
    kernel = cpu_attention.paged_decode_attention

    def record(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, req_indices,
               scale, out, k_scale, v_scale):  # fmt: skip
        if (k_scale, v_scale) != (1.0, 1.0) or req_indices.numel() != num_requests:
            raise RuntimeError("expected a step of plain decodes over an unscaled cache")
        layers.append(dict(
            q=q.clone(), k_cache=k_cache, v_cache=v_cache, block_table=block_table.clone(),
            query_start_loc=query_start_loc.clone(), seq_lens=seq_lens.clone(),
            req_indices=req_indices.clone(), scale=scale, out=out.clone(),
        ))  # fmt: skip
        return kernel(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, req_indices,
                      scale, out, k_scale, v_scale)  # fmt: skip

    cpu_attention.paged_decode_attention = record
    try:
        engine.step()
    finally:
        cpu_attention.paged_decode_attention = kernel
    return layers


def paged_runner(lib: Any, kernel: str, layers: list[dict[str, Any]], threads: int) -> Any:
    """Run `kernel` of library `lib` once on each layer's tensors, as `cpu_runtime.launch`
    does (one team per call)."""
    import ctypes

    from engine.kernels.cpu_attention import attention_args

    fn = ctypes.cast(getattr(lib, kernel), ctypes.c_void_p).value
    args = [
        attention_args(
            t["q"], t["k_cache"], t["v_cache"], t["block_table"], t["query_start_loc"],
            t["seq_lens"], t["req_indices"], t["scale"], t["out"], 1.0, 1.0,
        )
        for t in layers
    ]  # fmt: skip

    def run() -> None:
        for a, _ in zip(args, layers, strict=True):  # the tensors `args` points to stay alive
            lib.kvrail_run(fn, ctypes.byref(a), threads)

    return run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine import resolve_model  # first: it asks torch for 2 MiB pages, as the engine does

    # isort: split
    import torch
    from transformers import AutoConfig

    from engine.kernels.cpu_runtime import library
    from engine.model_runner import resolve_dtype
    from engine.models.llama import head_dim_of

    config = AutoConfig.from_pretrained(resolve_model(args.model))
    heads = (config.num_attention_heads, config.num_key_value_heads, head_dim_of(config))
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    n, batch = args.context_len, args.batch_size
    shapes = [(f"prompts 4 x {p}", "prompt", [p] * 4, [p] * 4, False, 1) for p in args.prompt_lens]
    for fp8, cache in ((False, ""), (True, ", fp8 cache")):
        shapes.append((f"decode, {n} cached{cache}", "decode", [1], [n], fp8, 1))
        shapes.append((f"decode {batch} x {n} cached, {args.layers} layers (DRAM){cache}",
                       "decode", [1] * batch, [n] * batch, fp8, args.layers))  # fmt: skip
    shapes += [
        (f"verify {q} queries, {n} cached", kernel, [q], [n], False, 1)
        for q in args.verify_queries
        for kernel in ("decode", "prompt")
    ]
    names = {"prompt": "kvrail_prefill_attention", "decode": "kvrail_decode_attention"}
    libraries = {"kvrail": library()}
    if args.baseline_ref is not None:
        libraries[f"baseline {args.baseline_ref}"] = baseline_library(args.baseline_ref)
    cases = []  # (label, kernel, library, run over its layers, layers, flop and bytes a layer)
    for label, kernel, q_lens, seq_lens, fp8, num_layers in shapes:
        layers = [
            make_case(torch, heads, dtype, args.block_size, q_lens, seq_lens, fp8)
            for _ in range(num_layers)
        ]
        flop = attended_flop(heads, q_lens, seq_lens)
        for lib_name, lib in libraries.items():
            run = paged_runner(lib, names[kernel], layers, threads)
            cases.append(
                (label, names[kernel], lib_name, run, num_layers, flop, kv_bytes(layers[0]))
            )
    if args.engine_batch:
        layers = engine_step_layers(args.model, args.engine_batch)
        seq_lens = layers[0]["seq_lens"].tolist()
        label = (f"decode, an int8 engine's step: {len(seq_lens)} x "
                 f"{sum(seq_lens) // len(seq_lens)} cached, {len(layers)} layers")  # fmt: skip
        flop = attended_flop(heads, [1] * len(seq_lens), seq_lens)
        for lib_name, lib in libraries.items():
            run = paged_runner(lib, names["decode"], layers, threads)
            cases.append((label, names["decode"], lib_name, run, len(layers), flop,
                          kv_bytes(layers[0])))  # fmt: skip
    # torch's SDPA on the same prompts, dense and contiguous (what a fresh prompt's own q, k
    # and v could go through without the paged cache): a yardstick for the prompt kernel.
    for n in args.prompt_lens:
        dense = {
            name: torch.randn(4, h, n, heads[2]).to(dtype)
            for name, h in (("query", heads[0]), ("key", heads[1]), ("value", heads[1]))
        }
        flop = attended_flop(heads, [n] * 4, [n] * 4)
        cases.append((f"prompts 4 x {n}", "dense_sdpa", "torch", lambda d=dense: dense_sdpa(**d),
                      1, flop, 0))  # fmt: skip
    times: dict[int, list[float]] = {i: [] for i in range(len(cases))}
    for case in cases:  # warm-up
        case[3]()
    for _ in range(args.rounds):
        for i, (_, _, _, run, num_layers, _, _) in enumerate(cases):
            run()  # this case's tensors back in cache after the others'
            start = time.perf_counter()
            for _ in range(args.repeats):
                run()
            times[i].append((time.perf_counter() - start) / args.repeats / num_layers)
    results = []
    for i, (label, kernel, lib_name, _, num_layers, flop, nbytes) in enumerate(cases):
        seconds = statistics.median(times[i])
        gbps = nbytes / seconds / 1e9 if num_layers > 1 else None
        results.append(
            dict(case=label, kernel=kernel, library=lib_name, us=1e6 * seconds,
                 gflops=flop / seconds / 1e9, gbps=gbps)
        )  # fmt: skip
    base = {(r["case"], r["kernel"]): r["us"] for r in results if r["library"].startswith("base")}
    rows = [
        [r["case"], r["kernel"], r["library"], fmt(r["us"], 1), fmt(r["gflops"], 1),
         fmt(r["gbps"], 1) if r["gbps"] else "-",
         f"{r['us'] / base[r['case'], r['kernel']]:.2f}"
         if r["library"] == "kvrail" and (r["case"], r["kernel"]) in base else "-"]
        for r in results
    ]  # fmt: skip
    markdown = "\n\n".join(
        [
            "# Attention kernels on the CPU, one layer",
            f"{heads[0]} query and {heads[1]} kv heads of {heads[2]}, {dtype} queries and "
            f"cache, blocks of {args.block_size} in random order, {threads} "
            f"threads, {platform.machine()}; medians of {args.rounds} rounds of "
            f"{args.repeats} calls in a row (cache-resident but for the batch of "
            f"{batch} over {args.layers} layers and an engine's step, which reads the "
            "engine's own cache and blocks), the cases taking turns. "
            "GFLOP/s: QK^T and PV over the keys each query attends to; GB/s: K and V read "
            "from DRAM; time / baseline: this checkout's kernel over the baseline ref's, "
            "the two in turn in one process.",
            markdown_table(
                ["case", "kernel", "library", "us", "GFLOP/s", "GB/s", "time / baseline"], rows
            ),
        ]
    )
    payload = dict(args=vars(args), dtype=str(dtype), results=results)
    write_results(args.name, payload, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
