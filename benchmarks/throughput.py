"""Offline throughput: kvrail against HF transformers and llama.cpp on one seeded workload.

In the manner of vLLM's `benchmark_throughput` and nano-vllm's bench: N requests whose
input and output lengths are drawn uniformly from ranges, prompts cut from real English
text, exactly `output_len` tokens each (EOS ignored, greedy). kvrail runs all N, in its
default configuration and with each of `--configs` (`kvrail-int8`), each configuration in a
process of its own started afresh, in an order that rotates over `--rounds`
(`engine_process`: of two engines, the one started first ran slower all along); the slow
peers run a seeded subset of the same requests and are compared per output token. The
machine's matmul rate on the model's shapes, measured in the same run, gives the compute
limit in tokens/s. `--baseline-ref REF` adds the before of a before/after: its
`--baseline-configs` run on REF's engine (a worktree) in the same rotation.

    python -m benchmarks.throughput --num-requests 128 --input-len 64:512 --output-len 64:256
    python -m benchmarks.throughput --configs int8 --peers none --baseline-ref HEAD~1 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    ENGINE_CONFIGS,
    FULL_WORKLOAD_KV_BYTES,
    BenchRequest,
    corpus_token_ids,
    fmt,
    greedy_params,
    linear_shapes,
    make_workload,
    markdown_table,
    measure_matmul_flops,
    model_flops_per_token,
    parse_range,
    seeded_subset,
    verdict,
    write_results,
)
from benchmarks.engine_process import git_ref
from benchmarks.peers import LLAMA_CPP_INSTALL, HFRunner, llama_cpp_available, run_llama_cpp

PEERS = ("hf-serial", "hf-static", "llama-cpp")
# Targets (issue 10): kvrail-int8's output tokens/s over each system's (over kvrail in its
# default dtype, 1.6x), and the default's share of the compute limit.
TARGETS = {
    "kvrail": 1.6,
    "hf-serial": 50.0,
    "hf-static": 6.0,
    "llama-cpp": 15.0,
    "compute": 0.40,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    add("--num-requests", type=int, default=128)
    add("--input-len", type=parse_range, default=(64, 512), help="LOW:HIGH prompt tokens")
    add("--output-len", type=parse_range, default=(64, 256), help="LOW:HIGH output tokens")
    add("--seed", type=int, default=0)
    add("--dtype", default="auto", help="kvrail's dtype (float32, bfloat16, auto)")
    add(
        "--configs",
        default="int8",
        help=f"comma list of kvrail runs besides the default, of {tuple(ENGINE_CONFIGS)[1:]}",
    )
    add("--rounds", type=int, default=1, help="kvrail runs per configuration, order rotating")
    add("--max-num-seqs", type=int, default=128)
    add("--max-num-batched-tokens", type=int, default=2048)
    # 4 GiB holds all 128 requests of the default workload at once in fp32 (46 KB a token).
    add("--kv-cache-memory-bytes", type=int, default=FULL_WORKLOAD_KV_BYTES,
        help="kvrail's KV pool on CPU")  # fmt: skip
    add("--peers", default=",".join(PEERS), help=f"comma list of {PEERS}, or 'none'")
    add("--serial-requests", type=int, default=8, help="subset size for one-at-a-time peers")
    add("--static-requests", type=int, default=32, help="subset size for HF static batching")
    add("--hf-batch-size", type=int, default=16)
    add("--hf-dtype", default="auto", help="auto = each HF peer at its faster of fp32/bf16")
    add("--matmul-tokens", type=int, default=256, help="rows of the compute-limit matmuls")
    add(
        "--baseline-ref",
        type=git_ref,
        default=None,
        help="git ref whose engine runs --baseline-configs too",
    )
    add("--baseline-configs", default="int8", help="configurations run at --baseline-ref")
    add("--name", default="throughput", help="results/<name>.json and .md")
    args = parser.parse_args(argv)
    args.peers = [] if args.peers == "none" else args.peers.split(",")
    args.configs = [c for c in args.configs.split(",") if c and c != "none"]
    args.baseline_configs = [c for c in args.baseline_configs.split(",") if c]
    unknown = set(args.peers) - set(PEERS)
    if unknown:
        parser.error(f"unknown peers {sorted(unknown)}; choose from {PEERS}")
    if set(args.configs) - set(ENGINE_CONFIGS) - {"default"} or "default" in args.configs:
        parser.error(f"configs: any of {tuple(ENGINE_CONFIGS)[1:]} (the default always runs)")
    if set(args.baseline_configs) - set(ENGINE_CONFIGS):
        parser.error(f"baseline configs: any of {tuple(ENGINE_CONFIGS)}")
    return args


def rates(requests: list[BenchRequest], seconds: float) -> dict[str, Any]:
    """Output and total tokens/s of `requests` finished in `seconds`."""
    output_tokens = sum(r.output_len for r in requests)
    total_tokens = output_tokens + sum(r.prompt_len for r in requests)
    return {
        "requests": len(requests),
        "seconds": seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "total_tokens_per_s": total_tokens / seconds,
    }


# In each kvrail configuration's process (`engine_process.EngineProcess`).
def describe(llm: Any) -> str:
    """The activations' dtype."""
    return str(llm.llm_engine.engine_core.model_runner.dtype).removeprefix("torch.")


def run_workload(llm: Any, prompts: list[list[int]], output_lens: list[int]) -> dict[str, Any]:
    """Seconds to generate `output_lens` tokens after `prompts`, all submitted at once, after
    a warm-up on reversed prompts (no prefix-cache hits on the measured ones)."""
    llm.generate([list(reversed(p)) for p in prompts[:4]], greedy_params(8))
    start = time.perf_counter()
    outputs = llm.generate(prompts, [greedy_params(n) for n in output_lens], use_tqdm=True)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != sum(output_lens):
        raise RuntimeError(f"kvrail produced {produced} output tokens, expected {sum(output_lens)}")
    return {"seconds": seconds, "num_preemptions": llm.llm_engine.get_stats().num_preemptions}


def workload_work(config: Any, workload: list[BenchRequest]) -> dict[str, float]:
    """What the workload asks of any engine, whatever its speed: a floor for a machine is each
    part at that machine's ceiling. Linear layers: every prompt token and every decode pass
    (each output token but the first, which the prompt's last position gives) through the
    layers, the LM head once per output token. Decode attention: each decode pass reads its
    whole context's K and V, per layer (bytes of a bf16 cache; fp8 halves them). Prompt
    attention: causal QK^T and PV over each prompt."""
    from engine.models.llama import head_dim_of

    *layers, (hidden, vocab) = linear_shapes(config)
    body = sum(n_in * n_out for n_in, n_out in layers)
    head_dim = head_dim_of(config)
    layers_heads = config.num_hidden_layers * config.num_attention_heads
    kv_bytes_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2
    prompt_lens = [len(r.prompt_token_ids) for r in workload]
    output_lens = [r.output_len for r in workload]
    decode_passes = sum(output_lens) - len(workload)
    # decode pass j = 1 .. o - 1 of a request attends to p + j tokens
    contexts = sum(
        (o - 1) * p + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens, strict=True)
    )
    linear_macs = (sum(prompt_lens) + decode_passes) * body + sum(output_lens) * hidden * vocab
    prompt_scores = sum(p * (p + 1) // 2 for p in prompt_lens)  # causal, per layer and head
    return {
        "linear_tera_ops": 2.0 * linear_macs / 1e12,
        "decode_kv_gigabytes": kv_bytes_per_token * contexts / 1e9,
        "prompt_attention_teraflops": 4.0 * layers_heads * head_dim * prompt_scores / 1e12,
    }


def run_kvrails(args: argparse.Namespace, workload: list[BenchRequest]) -> dict[str, Any]:
    """Each configuration's median time over `--rounds`, every run in a fresh process; with
    `--baseline-ref`, its `--baseline-configs` run in the same rotation (systems `baseline`,
    `baseline-<config>`), on that ref's engine."""
    from benchmarks.engine_process import EngineProcess, rotated, worktree

    systems = {  # name: (configuration, git ref or None for this checkout)
        "kvrail" if c == "default" else f"kvrail-{c}": (c, None) for c in ["default", *args.configs]
    }
    if args.baseline_ref is not None:
        systems |= {
            "baseline" if c == "default" else f"baseline-{c}": (c, args.baseline_ref)
            for c in args.baseline_configs
        }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    dtypes = {}
    prompts = [r.prompt_token_ids for r in workload]
    output_lens = [r.output_len for r in workload]
    with contextlib.ExitStack() as stack:
        trees = {ref: stack.enter_context(worktree(ref)) for _, ref in systems.values()}
        for r in range(args.rounds):
            for name in rotated(list(systems), r):
                config, ref = systems[name]
                options = {
                    "model": args.model,
                    "dtype": args.dtype,
                    **ENGINE_CONFIGS[config],
                    "max_num_seqs": args.max_num_seqs,
                    "max_num_batched_tokens": args.max_num_batched_tokens,
                    "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
                }
                with EngineProcess(__file__, options, "describe", trees[ref]) as child:
                    dtypes[name] = child.ready
                    runs[name].append(child.call("run_workload", prompts, output_lens))
    results = {}
    for name, (config, ref) in systems.items():
        options = ENGINE_CONFIGS[config]
        dtype = dtypes[name]
        seconds = [run["seconds"] for run in runs[name]]
        results[name] = {
            **rates(workload, statistics.median(seconds)),
            "seconds_by_round": seconds,
            "dtype": ", ".join(
                [f"{options['quantization']} ({dtype})" if "quantization" in options else dtype]
                + [f"{kv} kv" for kv in [options.get("kv_cache_dtype")] if kv]
                + ([f"at {ref}"] if ref else [])
            ),
            "num_preemptions": max(run["num_preemptions"] for run in runs[name]),
        }
    return results


def run_hf_peers(
    args: argparse.Namespace, model_dir: Path, workload: list[BenchRequest], pad_id: int
) -> dict[str, dict[str, Any]]:
    """HF one request at a time and in static batches, each at its faster dtype."""
    hf = HFRunner(model_dir, pad_id)
    dtypes = ("float32", "bfloat16") if args.hf_dtype == "auto" else (args.hf_dtype,)
    results = {}
    if "hf-serial" in args.peers:
        requests = seeded_subset(workload, args.serial_requests, args.seed)
        dtype = hf.choose_dtype(dtypes, [shortened(r, 16) for r in requests[:2]], None)
        seconds = hf.run_serial(dtype, requests, desc=f"hf serial ({dtype})")
        results["hf-serial"] = {**rates(requests, seconds), "dtype": dtype}
    if "hf-static" in args.peers:
        requests = seeded_subset(workload, args.static_requests, args.seed)
        probe = [shortened(r, 8) for r in requests[: args.hf_batch_size]]
        dtype = hf.choose_dtype(dtypes, probe, args.hf_batch_size)
        seconds = hf.run_static(dtype, requests, args.hf_batch_size, desc=f"hf static ({dtype})")
        results["hf-static"] = {**rates(requests, seconds), "dtype": dtype}
    return results


def shortened(request: BenchRequest, output_len: int) -> BenchRequest:
    """The same prompt with a short output: a cheap probe of decode and prefill speed."""
    return BenchRequest(request.request_id, request.prompt_token_ids, output_len)


def run_llama_peer(
    args: argparse.Namespace, workload: list[BenchRequest]
) -> tuple[dict[str, Any] | None, str | None]:
    """llama.cpp's result, or None and the reason it was skipped."""
    if not llama_cpp_available():
        return None, f"llama-cpp-python or its library is missing; see {LLAMA_CPP_INSTALL}"
    if args.model is not None and not str(args.model).endswith(".gguf"):
        return None, "llama.cpp needs a .gguf model; --model is an HF folder"
    from engine.loader import _default_gguf

    gguf = Path(args.model) if args.model else _default_gguf()
    requests = seeded_subset(workload, args.serial_requests, args.seed)
    n_ctx = max(r.prompt_len + r.output_len for r in workload) + 16
    seconds = run_llama_cpp(gguf, requests, n_ctx)
    return {**rates(requests, seconds), "dtype": "gguf (Q4_1)"}, None


def report(
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    compute: dict[str, float],
    notes: list[str],
) -> str:
    """The markdown: per system rates and each kvrail's ratio to it. The targets judge
    `kvrail-int8`, the configuration issue 10 names, whatever else ran after it (without it,
    the last configuration run)."""
    kvrails = [name for name in results if name.startswith("kvrail")]
    judged = "kvrail-int8" if "kvrail-int8" in kvrails else kvrails[-1]
    rows = []
    for name, r in results.items():
        ratios = [results[k]["output_tokens_per_s"] / r["output_tokens_per_s"] for k in kvrails]
        target = TARGETS.get(name) if name != judged else None
        rows.append(
            [
                name,
                r["dtype"],
                r["requests"],
                fmt(r["seconds"]),
                fmt(r["output_tokens_per_s"]),
                fmt(r["total_tokens_per_s"]),
                *(
                    "-" if k == name else f"{ratio:.2f}x"
                    for k, ratio in zip(kvrails, ratios, strict=True)
                ),
                f">= {target:g}x" if target else "-",
                verdict(ratios[kvrails.index(judged)], target) if target else "-",
            ]
        )
    default = results["kvrail"]
    share = default["total_tokens_per_s"] / compute["limit_tokens_per_s"]
    rows.append(
        [
            "compute limit",
            compute["dtype"],
            "-",
            "-",
            "-",
            fmt(compute["limit_tokens_per_s"]),
            f"{share:.1%} used",
            *["-"] * (len(kvrails) - 1),
            f">= {TARGETS['compute']:.0%}",
            verdict(share, TARGETS["compute"]),
        ]
    )
    headers = [
        "system",
        "dtype",
        "requests",
        "s",
        "output tok/s",
        "total tok/s",
        *(f"{k} / system" for k in kvrails),
        f"target ({judged})",
        "verdict",
    ]
    lines = [
        "# Offline throughput",
        "",
        f"Workload: {args.num_requests} requests, inputs {args.input_len[0]}-{args.input_len[1]},"
        f" outputs {args.output_len[0]}-{args.output_len[1]} tokens, seed {args.seed}, greedy,"
        f" EOS ignored. kvrail: max_num_seqs {args.max_num_seqs}, max_num_batched_tokens"
        f" {args.max_num_batched_tokens}, KV pool {args.kv_cache_memory_bytes / 2**30:g} GiB,"
        f" {default['num_preemptions']} preemptions; each configuration in a fresh process,"
        f" {args.rounds} round(s) in rotating order, median seconds.",
        f"Compute limit: {compute['dtype']} matmuls (the faster dtype here; the faster of torch's"
        " matmul and, in bf16 with AVX512-BF16, kvrail's packed kernel) on the model's"
        f" shapes at M={args.matmul_tokens} rows ran at {compute['matmul_gflops']:.0f} GFLOP/s;"
        " the model costs"
        f" {compute['gflop_per_token']:.3f} GFLOP/token (the compute-limit row is the default"
        " dtype's share).",
        "",
        markdown_table(headers, rows),
    ]
    lines += [""] + [f"- {note}" for note in notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoConfig

    from engine.loader import load_tokenizer, resolve_model

    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    workload = make_workload(
        corpus_token_ids(tokenizer), args.num_requests, args.input_len, args.output_len, args.seed
    )
    # The machine's limit is its faster dtype: bf16 on AVX512-BF16/AMX, fp32 on AVX2 alone.
    flops, dtype = max(
        (measure_matmul_flops(config, args.matmul_tokens, d), d) for d in ("float32", "bfloat16")
    )
    per_token = model_flops_per_token(config)
    compute = {
        "dtype": dtype,
        "matmul_gflops": flops / 1e9,
        "gflop_per_token": per_token / 1e9,
        "limit_tokens_per_s": flops / per_token,
    }
    results = run_kvrails(args, workload)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    results.update(run_hf_peers(args, model_dir, workload, pad_id))
    notes = []
    if "llama-cpp" in args.peers:
        llama, why_not = run_llama_peer(args, workload)
        if llama is None:
            notes.append(f"llama.cpp skipped: {why_not}")
        else:
            results["llama-cpp"] = llama
    notes.append("Peers run a seeded subset of the same requests; ratios are per output token.")
    work = workload_work(config, workload)
    notes.append(
        f"The workload's work (`workload_work`): {work['linear_tera_ops']:.2f} TOP in linear"
        f" layers, {work['decode_kv_gigabytes']:.1f} GB of K and V read by decode attention from"
        f" a bf16 cache (half from fp8), {work['prompt_attention_teraflops']:.3f} TFLOP of prompt"
        " attention."
    )
    markdown = report(args, results, compute, notes)
    payload = {
        "args": vars(args),
        "compute": compute,
        "work": work,
        "results": results,
        "notes": notes,
    }
    write_results(args.name, payload, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
