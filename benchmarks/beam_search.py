"""Beam search's KV blocks: beams that share their prefix, against independent sequences.

In-process, an offline `LLMEngine` (`--model`, default SmolLM2-135M-Instruct) runs each prompt
of a fixed set (`--num-prompts` windows of `--prompt-len` tokens of the benchmarks' corpus at
seeded offsets, `common.make_workload`) side by side, each run alone on the engine and every
sequence exactly `--max-tokens` long (EOS ignored, so that lengths match):
- greedy: one sequence;
- beam: a beam search of `--beam-width` beams (`BeamSearchParams`): each beam is forked from
  the request of the beam it continues, sharing its KV blocks by reference count, the partly
  filled last block copied on write (`engine/beam_search.py`);
- no sharing: what `--beam-width` independent sequences of that length hold, beam_width x
  greedy's peak (a beam search whose beams copied their prefixes).

The blocks in use are read after each step's scheduling, while the step's forward holds them;
a run's peak is their maximum. Target (issue 15): beam's peak at most 1.6x greedy's, on every
prompt. Also reported: the copies on write per search and the wall times.

    python -m benchmarks.beam_search
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from benchmarks.common import (
    corpus_token_ids,
    fmt,
    greedy_params,
    make_workload,
    markdown_table,
    verdict,
    warm_up,
    write_results,
)

TARGET_RATIO = 1.6  # beam search's peak KV blocks / one greedy sequence's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    add("--dtype", default="auto")
    add("--beam-width", type=int, default=4)
    add("--num-prompts", type=int, default=8)
    add("--prompt-len", type=int, default=256, help="tokens of each prompt")
    add("--max-tokens", type=int, default=64, help="tokens of each sequence")
    add("--seed", type=int, default=0)
    add("--name", default="beam_search", help="results/<name>.json and .md")
    return parser.parse_args(argv)


def run_alone(engine: Any, prompt_token_ids: list[int], params: Any) -> dict[str, Any]:
    """One request alone on the engine: its peak blocks in use, copies on write, wall time."""
    scheduler = engine.engine_core.scheduler
    kv = scheduler.kv_cache_manager
    peak, num_copies = 0, 0
    schedule = scheduler.schedule

    def measured_schedule(*args: Any, **kwargs: Any) -> Any:
        nonlocal peak, num_copies
        output = schedule(*args, **kwargs)
        peak = max(peak, kv.get_num_blocks_in_use())
        num_copies += len(output.blocks_to_copy)
        return output

    scheduler.schedule = measured_schedule
    try:
        start = time.perf_counter()
        engine.add_request("bench", prompt_token_ids, params)
        while engine.has_unfinished_requests():
            engine.step()
        duration = time.perf_counter() - start
    finally:
        del scheduler.schedule  # the class's method again
    return {"peak_blocks": peak, "copies_on_write": num_copies, "duration_s": duration}


def measure(engine: Any, prompts: list[list[int]], beam_width: int, max_tokens: int) -> list:
    """Per prompt: greedy and beam search side by side, and the no-sharing figure."""
    from engine import BeamSearchParams

    beam = BeamSearchParams(beam_width, max_tokens, ignore_eos=True)
    results = []
    for prompt in prompts:
        greedy_run = run_alone(engine, prompt, greedy_params(max_tokens))
        beam_run = run_alone(engine, prompt, beam)
        results.append(
            {
                "prompt_len": len(prompt),
                "greedy": greedy_run,
                "beam": beam_run,
                "no_sharing_blocks": beam_width * greedy_run["peak_blocks"],
                "ratio": beam_run["peak_blocks"] / greedy_run["peak_blocks"],
            }
        )
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine import LLMEngine

    engine = LLMEngine.from_kwargs(model=args.model, dtype=args.dtype)
    warm_up(engine)
    workload = make_workload(
        corpus_token_ids(engine.tokenizer),
        args.num_prompts,
        (args.prompt_len, args.prompt_len),
        (args.max_tokens, args.max_tokens),
        args.seed,
    )
    results = measure(
        engine, [r.prompt_token_ids for r in workload], args.beam_width, args.max_tokens
    )
    worst = max(r["ratio"] for r in results)
    mean = sum(r["ratio"] for r in results) / len(results)
    rows = [
        [
            i,
            r["prompt_len"],
            r["greedy"]["peak_blocks"],
            r["beam"]["peak_blocks"],
            r["no_sharing_blocks"],
            fmt(r["ratio"], 2),
            fmt(r["no_sharing_blocks"] / r["greedy"]["peak_blocks"], 2),
            r["beam"]["copies_on_write"],
            fmt(r["greedy"]["duration_s"], 2),
            fmt(r["beam"]["duration_s"], 2),
        ]
        for i, r in enumerate(results)
    ]
    headers = [
        "prompt",
        "prompt tokens",
        "greedy peak blocks",
        "beam peak blocks",
        "no-sharing blocks",
        "beam / greedy",
        "no-sharing / greedy",
        "copies on write",
        "greedy s",
        "beam s",
    ]
    block_size = engine.config.block_size
    markdown = "\n".join(
        [
            "# Beam search: KV blocks shared between beams",
            "",
            f"{args.num_prompts} prompts of {args.prompt_len} corpus tokens (seed {args.seed}),"
            f" every sequence {args.max_tokens} tokens (EOS ignored); beam width"
            f" {args.beam_width}; blocks of {block_size} tokens; dtype {args.dtype}. Peak: the"
            " most blocks in use at any step's forward; no sharing: beam width x greedy's peak.",
            "",
            markdown_table(headers, rows),
            "",
            f"Target: beam search's peak <= {TARGET_RATIO}x greedy's on every prompt: worst"
            f" {fmt(worst, 2)}x (mean {fmt(mean, 2)}x, no sharing {args.beam_width}x),"
            f" {verdict(worst, TARGET_RATIO, higher_is_better=False)}.",
        ]
    )
    summary = {"worst_ratio": worst, "mean_ratio": mean, "target_ratio": TARGET_RATIO}
    payload = {"args": vars(args), "results": results, "summary": summary}
    write_results(args.name, payload, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
