"""Streaming-input sessions: a chat of `--turns` turns sent turn by turn to one session,
against the same chat re-sending its whole history each turn with prefix caching on.

In-process, as `benchmarks.priority`: two offline `LLMEngine`s (prefix caching on in both),
driven turn by turn, the two conversations' turns interleaved so that both see the same
machine. Per turn, the next user message of a fixed list:
- session: `add_request("chat", <the turn>, resumable=True)`; turn 1 is the conversation's
  chat template, each later one `apply_chat_continuation` after the tokens so far (the end
  of the assistant's turn, the user message, the generation prompt);
- re-sent: `add_request` of the whole conversation so far (its own earlier answers as text)
  through the chat template, as an OpenAI client does, each turn a new request.

Every turn generates `--output-len` tokens, greedy, EOS ignored, so both do the same decode
work. Computed prefill tokens are the engine's `EngineStats.num_prefill_tokens` (prompt
tokens scheduled: neither found in the prefix cache nor kept by a session); TTFT runs from
templating a turn to its first token.

Why a session can beat prefix caching: the prefix cache reuses only full blocks (16 tokens)
of a token sequence seen before, so a re-sent turn recomputes the partly filled last block of
the history; and the history comes back as text, which tokenizes again otherwise than the
tokens generated (BPE does not round-trip arbitrary model output, and the turn boundary
`<|im_end|>` after the answer was never generated with ignore_eos), so everything after the
first differing token is recomputed. The session keeps every token's KV, the partial block
and the generated tokens' included, and computes only the new ones plus the last token
generated (its KV was never written).

Target (issue 15): the session computes at least 5x fewer prefill tokens over the whole
conversation and has a lower median TTFT per turn.

    python -m benchmarks.sessions
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks.common import fmt, markdown_table, verdict, warm_up, write_results

TARGET_PREFILL_RATIO = 5.0  # re-sent / session computed prefill tokens, whole conversation
QUESTIONS = [
    "What is a KV cache in a transformer, and why does it make decoding faster?",
    "How much memory does it take for a model with 30 layers?",
    "Why do servers split it into fixed-size blocks?",
    "What happens when two requests share the same prompt prefix?",
    "And when the pool runs out of blocks?",
    "Is recomputing cheaper than swapping to host memory?",
    "How does continuous batching decide what runs next?",
    "What does chunked prefill change for latency?",
    "Can you summarise all of this in three sentences?",
    "Thanks! One last question: what should I read next?",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    add("--dtype", default="auto")
    add("--turns", type=int, default=len(QUESTIONS), help=f"at most {len(QUESTIONS)}")
    add("--output-len", type=int, default=64, help="tokens generated per turn")
    add("--name", default="sessions", help="results/<name>.json and .md")
    args = parser.parse_args(argv)
    if not 1 <= args.turns <= len(QUESTIONS):
        parser.error(f"--turns must be in [1, {len(QUESTIONS)}]")
    return args


def run_turn(engine: Any, request_id: str, prompt: list[int], params: Any, **kwargs: Any):
    """Add one turn and step until it ends: when its first token came, its tokens, its text
    and the prompt tokens the engine computed for it."""
    prefill_before = engine.get_stats().num_prefill_tokens
    engine.add_request(request_id, prompt, params, **kwargs)
    first_token_s, token_ids, text = None, [], ""
    while True:
        for output in engine.step():
            completion = output.outputs[0]
            if completion.token_ids and first_token_s is None:
                first_token_s = time.perf_counter()
            token_ids += completion.token_ids
            text += completion.text
            if completion.finish_reason is not None:
                prefill = engine.get_stats().num_prefill_tokens - prefill_before
                return first_token_s, token_ids, text, prefill


def converse(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both conversations, turn by turn (interleaved): per turn, each side's figures."""
    from engine import LLMEngine, SamplingParams, apply_chat_continuation, apply_chat_template

    # 4,096 tokens of KV each: room for the whole conversation (about 1,000 tokens)
    options = dict(
        model=args.model, dtype=args.dtype, max_model_len=2048, num_kv_blocks=256
    )  # prefix caching on (the default) in both
    session_engine = LLMEngine.from_kwargs(**options)
    resent_engine = LLMEngine.from_kwargs(**options)
    for engine in (session_engine, resent_engine):
        warm_up(engine)
    tokenizer = session_engine.tokenizer
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    history: list[int] = []  # the session's tokens so far
    messages: list[dict[str, str]] = []  # the re-sent conversation
    turns = []
    for turn, question in enumerate(QUESTIONS[: args.turns]):
        user = {"role": "user", "content": question}
        last = turn == args.turns - 1
        start = time.perf_counter()
        if turn == 0:
            chunk = apply_chat_template(tokenizer, [user])[1]
        else:
            chunk = apply_chat_continuation(tokenizer, [user], history)[1]
        first_s, answer, _, prefill = run_turn(
            session_engine, "chat", chunk, params, resumable=not last
        )
        context = len(history) + len(chunk)
        session = {"ttft_ms": (first_s - start) * 1000, "prefill": prefill, "context": context}
        history += chunk + answer

        messages.append(user)
        hits_before = resent_engine.get_stats().prefix_cache_hits
        start = time.perf_counter()
        prompt = apply_chat_template(tokenizer, messages)[1]
        first_s, _, text, prefill = run_turn(resent_engine, f"turn-{turn}", prompt, params)
        messages.append({"role": "assistant", "content": text})
        hits = resent_engine.get_stats().prefix_cache_hits - hits_before
        resent = {"ttft_ms": (first_s - start) * 1000, "prefill": prefill, "context": len(prompt)}
        resent["prefix_cache_hits"] = hits
        turns.append({"turn": turn + 1, "session": session, "resent": resent})
    for engine in (session_engine, resent_engine):
        kv = engine.engine_core.scheduler.kv_cache_manager
        assert kv.get_num_blocks_in_use() == 0, "a turn left blocks in use"
    return turns


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    turns = converse(args)
    total = {side: sum(t[side]["prefill"] for t in turns) for side in ("session", "resent")}
    later = {side: sum(t[side]["prefill"] for t in turns[1:]) for side in ("session", "resent")}
    median_ttft = {
        side: statistics.median(t[side]["ttft_ms"] for t in turns) for side in ("session", "resent")
    }
    ratio = total["resent"] / total["session"]
    later_ratio = later["resent"] / later["session"] if len(turns) > 1 else None
    ttft_ok = median_ttft["session"] < median_ttft["resent"]
    rows = [
        [
            t["turn"],
            t["session"]["context"],
            t["resent"]["context"],
            t["session"]["prefill"],
            t["resent"]["prefill"],
            t["resent"]["prefix_cache_hits"],
            fmt(t["session"]["ttft_ms"]),
            fmt(t["resent"]["ttft_ms"]),
        ]
        for t in turns
    ]
    rows.append(
        ["all", "", "", total["session"], total["resent"], "", fmt(median_ttft["session"]),
         fmt(median_ttft["resent"])]
    )  # fmt: skip
    headers = [
        "turn",
        "session context",
        "re-sent prompt",
        "session prefill",
        "re-sent prefill",
        "re-sent cache hits",
        "session TTFT ms",
        "re-sent TTFT ms",
    ]
    markdown = "\n".join(
        [
            "# Streaming-input sessions against re-sending the history",
            "",
            f"A {len(turns)}-turn chat (`QUESTIONS`), {args.output_len} tokens a turn (greedy,"
            f" EOS ignored), model {args.model or 'SmolLM2-135M-Instruct'}, dtype {args.dtype},"
            " prefix caching on in both engines; prefill = prompt tokens computed"
            " (`EngineStats.num_prefill_tokens`); the last row: totals and median TTFTs.",
            "",
            markdown_table(headers, rows),
            "",
            f"Target: re-sent / session prefill tokens over the conversation >= "
            f"{TARGET_PREFILL_RATIO:.0f}x: {fmt(ratio, 2)}x, "
            f"{verdict(ratio, TARGET_PREFILL_RATIO)} (turns 2-{len(turns)} alone:"
            f" {fmt(later_ratio, 2)}x). Median TTFT per turn lower with the session: "
            f"{fmt(median_ttft['session'])} ms against {fmt(median_ttft['resent'])} ms, "
            f"{'PASS' if ttft_ok else 'FAIL'}.",
        ]
    )
    payload = {
        "args": vars(args),
        "turns": turns,
        "prefill_total": total,
        "prefill_later_turns": later,
        "prefill_ratio": ratio,
        "prefill_ratio_later_turns": later_ratio,
        "median_ttft_ms": median_ttft,
    }
    write_results(args.name, payload, markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
