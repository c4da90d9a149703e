"""Prompt lookup replayed: the steps each ngram `speculative_config` takes, counted, not timed.

Greedy outputs do not depend on speculation (it is lossless: `spec_decode.py` checks it token
for token in float32), so once the engine without speculation has answered the single-stream
sets of `spec_decode.py`, what prompt lookup does on them is arithmetic: before each decode
step the proposer (`NgramProposer`, the engine's own) sees the prompt and the tokens so far; a
step with drafts is a verify step and emits the drafts' prefix that matches the output plus
one more token, a step without is a plain step and emits one. That gives every config's plain
and verify steps, and its acceptance, in seconds and free of a shared machine's noise, where
timing one config takes `spec_decode.py` minutes.

What the steps cost is the one figure that needs timing: with r = a verify step's wall time
over a plain decode step's (`spec_decode.py`'s step table: "verify / base plain"), decode
alone runs (tokens) / (plain steps + r x verify steps) times as fast as without speculation.
The table gives that at each `--verify-ratios` and the largest r at which decode alone still
reaches `--target` ("< 1": not even with verify steps as cheap as plain ones; "-": no
drafts). The prompts' prefill, the same with and without speculation, is not counted: the
measured ratio of `spec_decode.py` sits below the decode-only one.

    python -m benchmarks.spec_replay --k 3,4,5,6,8 --lookup-min 1,2 --name spec_replay
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
from tqdm import tqdm

from benchmarks.common import fmt, markdown_table, write_results
from benchmarks.spec_decode import Task, chat_tasks
from benchmarks.spec_decode import parse_args as spec_decode_args
from benchmarks.spec_workload import FREE_FORM, GROUNDED


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    add("--dtype", default="float32", help="of the engine that writes the outputs")
    add("--k", default="2,3,4,5,6,8", help="num_speculative_tokens values")
    add("--lookup-min", default="1,2,3", help="prompt_lookup_min values")
    add("--lookup-max", default="4", help="prompt_lookup_max values")
    add("--verify-ratios", default="1.1,1.25,1.5", help="verify / plain step times to price")
    add("--target", type=float, default=2.0, help="decode-only speedup the break-even r is for")
    add("--name", default="spec_replay", help="results/<name>.json and .md")
    args = parser.parse_args(argv)
    try:
        for name in ("k", "lookup_min", "lookup_max"):
            setattr(args, name, [int(v) for v in getattr(args, name).split(",")])
        args.verify_ratios = [float(v) for v in args.verify_ratios.split(",")]
    except ValueError as e:
        parser.error(f"--k, --lookup-min, --lookup-max and --verify-ratios take comma lists: {e}")
    if min(args.k + args.lookup_min + args.lookup_max) < 1 or min(args.verify_ratios) < 1:
        parser.error("--k, --lookup-min, --lookup-max and --verify-ratios take values >= 1")
    if args.target <= 0:
        parser.error("--target must be > 0")
    return args


def greedy_outputs(llm: Any, tasks: list[Task], set_name: str) -> list[list[int]]:
    """Each task's output token ids from the engine without speculation, one request at a
    time as `spec_decode.py` sends them (a batch's prompt shapes could round otherwise)."""
    outputs = []
    for task in tqdm(tasks, desc=f"greedy outputs, {set_name}"):
        (out,) = llm.generate([task.prompt_token_ids], task.sampling_params(), use_tqdm=False)
        outputs.append(list(out.outputs[0].token_ids))
    return outputs


def replay(propose: Any, prompts: list[list[int]], outputs: list[list[int]]) -> dict[str, int]:
    """Plain and verify decode steps (after each prompt's own step, which samples the first
    token), draft tokens and accepted ones, for a proposer over these greedy outputs."""
    counts = dict(tokens=0, plain=0, verify=0, draft_tokens=0, accepted=0)
    for prompt, output in zip(prompts, outputs, strict=True):
        token_ids = np.array(prompt + output, dtype=np.int64)
        pos = 1  # output tokens known: the prompt step sampled the first
        while pos < len(output):
            drafts = propose(token_ids[: len(prompt) + pos])
            num_accepted = 0
            while (
                num_accepted < len(drafts)
                and pos + num_accepted < len(output)
                and drafts[num_accepted] == output[pos + num_accepted]
            ):
                num_accepted += 1
            counts["verify" if drafts else "plain"] += 1
            counts["draft_tokens"] += len(drafts)
            counts["accepted"] += num_accepted
            pos += num_accepted + 1
        counts["tokens"] += len(output) - 1
    return counts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine import LLM
    from engine.spec_decode.ngram_proposer import NgramProposer

    llm = LLM(model=args.model, dtype=args.dtype)
    workload = spec_decode_args([])  # the chat sets exactly as spec_decode.py builds them
    results: list[dict[str, Any]] = []
    for set_name, entries in (("grounded", GROUNDED), ("free-form", FREE_FORM)):
        tasks = chat_tasks(workload, llm.get_tokenizer(), entries)
        prompts = [t.prompt_token_ids for t in tasks]
        outputs = greedy_outputs(llm, tasks, set_name)
        for k in args.k:
            for lookup_max in args.lookup_max:
                for lookup_min in (m for m in args.lookup_min if m <= lookup_max):
                    proposer = NgramProposer(k, lookup_min, lookup_max)
                    c = replay(proposer.propose, prompts, outputs)
                    speedups = {
                        r: c["tokens"] / (c["plain"] + r * c["verify"]) for r in args.verify_ratios
                    }
                    # tokens / (plain + r verify) = target: r = (tokens / target - plain) / verify
                    break_even = (
                        (c["tokens"] / args.target - c["plain"]) / c["verify"]
                        if c["verify"]
                        else None
                    )
                    results.append(
                        dict(set=set_name, k=k, lookup_min=lookup_min, lookup_max=lookup_max,
                             **c, speedup=speedups, break_even_ratio=break_even)
                    )  # fmt: skip
    rows = [
        [
            r["set"], r["k"], r["lookup_min"], r["lookup_max"], r["plain"], r["verify"],
            fmt(r["accepted"] / r["draft_tokens"] if r["draft_tokens"] else None, 3),
            fmt(r["tokens"] / (r["plain"] + r["verify"]), 2),
            *(f"{fmt(r['speedup'][v], 2)}x" for v in args.verify_ratios),
            "-" if r["break_even_ratio"] is None
            else "< 1" if r["break_even_ratio"] < 1
            else fmt(r["break_even_ratio"], 2),
        ]
        for r in results
    ]  # fmt: skip
    headers = [
        "set", "k", "lookup min", "lookup max", "plain steps", "verify steps", "acceptance rate",
        "tokens / step", *(f"decode speedup at r = {v}" for v in args.verify_ratios),
        f"largest r for {args.target}x",
    ]  # fmt: skip
    markdown = "\n\n".join(
        [
            "# Prompt lookup replayed over greedy outputs",
            f"Outputs of the engine without speculation ({args.dtype}) on `spec_decode.py`'s "
            "single-stream sets; steps after each prompt's own. r: a verify step's time over a "
            "plain decode step's; decode speedup = tokens / (plain + r x verify), prefill not "
            "counted.",
            markdown_table(headers, rows),
        ]
    )
    write_results(args.name, {"args": vars(args), "results": results}, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
