"""Quality of the cheaper formats: perplexity and greedy agreement against the default dtype.

Perplexity of a fixed English text that ships with every Python, the documentation topics
of `pydoc_data.topics` (the first `--max-tokens` tokens, in windows of `--window` tokens:
each token is predicted from the earlier ones of its window), computed from the engine's
own `prompt_logprobs`. Then the first `--output-len` greedy tokens of `--num-prompts`
prompts (windows of the benchmarks' corpus), compared with the default configuration's:
how many prompts agree entirely, and the mean length of the common prefix.

    python -m benchmarks.quality --configs default,int8,fp8-kv
"""

from __future__ import annotations

import argparse
import math
import platform
from typing import Any

from benchmarks.common import (
    ENGINE_CONFIGS,
    corpus_token_ids,
    fmt,
    greedy_params,
    make_workload,
    markdown_table,
    verdict,
    write_results,
)

CONFIGS = ("default", "int8", "fp8-kv")  # of ENGINE_CONFIGS, scored by default
# Perplexity over the default configuration's, at most (issue 10).
TARGETS = {"int8": 1.03, "fp8-kv": 1.01}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    add("--configs", default=",".join(CONFIGS), help=f"comma list of {tuple(ENGINE_CONFIGS)}")
    add("--dtype", default="auto", help="the activations' dtype, for every config")
    add("--max-tokens", type=int, default=32768, help="tokens of the text scored")
    add("--window", type=int, default=1024, help="tokens per scored window")
    add("--num-prompts", type=int, default=20)
    add("--prompt-len", type=int, default=64)
    add("--output-len", type=int, default=32)
    add("--seed", type=int, default=0)
    add("--name", default="quality", help="results/<name>.json and .md")
    args = parser.parse_args(argv)
    args.configs = args.configs.split(",")
    if args.configs[0] != "default" or set(args.configs) - set(ENGINE_CONFIGS):
        parser.error(f"configs: 'default' first, then any of {tuple(ENGINE_CONFIGS)}")
    return args


def evaluation_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[key] for key in sorted(topics))


def perplexity(llm: Any, windows: list[list[int]]) -> tuple[float, int]:
    """exp(mean negative log-likelihood) of every token but each window's first."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(windows, params, use_tqdm=True)
    nll, count = 0.0, 0
    for window, output in zip(windows, outputs, strict=True):
        for token_id, position in zip(window[1:], output.prompt_logprobs[1:], strict=True):
            nll -= position[token_id].logprob
            count += 1
    return math.exp(nll / count), count


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine import LLM
    from engine.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model))
    text_ids = tokenizer.encode(evaluation_text(), add_special_tokens=False)[: args.max_tokens]
    windows = [text_ids[i : i + args.window] for i in range(0, len(text_ids), args.window)]
    windows = [w for w in windows if len(w) > 1]
    workload = make_workload(
        corpus_token_ids(tokenizer),
        args.num_prompts,
        (args.prompt_len, args.prompt_len),
        (args.output_len, args.output_len),
        args.seed,
    )
    prompts = [r.prompt_token_ids for r in workload]
    results: dict[str, dict[str, Any]] = {}
    for name in args.configs:
        llm = LLM(args.model, dtype=args.dtype, **ENGINE_CONFIGS[name])
        dtype = str(llm.llm_engine.engine_core.model_runner.dtype).removeprefix("torch.")
        ppl, count = perplexity(llm, windows)
        tokens = [
            o.outputs[0].token_ids for o in llm.generate(prompts, greedy_params(args.output_len))
        ]
        results[name] = {
            "perplexity": ppl,
            "scored_tokens": count,
            "dtype": dtype,
            "tokens": tokens,
        }
        del llm
    base = results["default"]
    rows = []
    for name, r in results.items():
        prefixes = [
            next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
            for x, y in zip(r["tokens"], base["tokens"], strict=True)
        ]
        r["common_prefix"] = prefixes
        ratio = r["perplexity"] / base["perplexity"]
        target = TARGETS.get(name)
        rows.append(
            [
                name,
                fmt(r["perplexity"], 3),
                f"{ratio:.4f}x",
                f"<= {target}x" if target else "-",
                verdict(ratio, target, higher_is_better=False) if target else "-",
                f"{sum(p == args.output_len for p in prefixes)} / {len(prefixes)}",
                fmt(sum(prefixes) / len(prefixes)),
            ]
        )
    lines = [
        "# Quality against the default configuration",
        "",
        f"Perplexity of the first {base['scored_tokens'] + len(windows)} tokens of"
        f" `pydoc_data.topics` (Python {platform.python_version()}), windows of {args.window}"
        f" tokens, from `prompt_logprobs`; activations in {base['dtype']}. Greedy agreement:"
        f" the first {args.output_len} tokens of {args.num_prompts} prompts of"
        f" {args.prompt_len} tokens against the default configuration's.",
        "",
        markdown_table(
            [
                "config",
                "perplexity",
                "/ default",
                "target",
                "verdict",
                f"prompts identical ({args.output_len} tokens)",
                "mean common prefix",
            ],
            rows,
        ),
    ]
    write_results(args.name, {"args": vars(args), "results": results}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
