"""The `kvrail` command line."""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(model=args.model)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    messages = [{"role": "user", "content": args.prompt}]
    (output,) = llm.chat(messages, params) if not args.raw else llm.generate(args.prompt, params)
    print(output.outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrail", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer one prompt from the command line")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF folder or .gguf file (default SmolLM2)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.set_defaults(func=_generate)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
