"""Speculative decoding: output tok/s with and without it, side by side in one run.

Speculation pays only when drafts are accepted, so it is measured where it should win and
where it must not lose (issue 13):

- `grounded`: one request at a time, the input-grounded tasks of `spec_workload.py` (copy a
  paragraph, edit a function, convert a table, fix spelling) sent through the model's chat
  template: the answer repeats the input, so prompt lookup (ngram) drafts well. Target: the
  speculative engine >= 2x the output tok/s of the same engine without speculation.
- `free-form`: one request at a time, open chat questions, nothing to copy. Target >= 0.95x.
- `batch`: `--batch-requests` corpus windows (the workload of `throughput.py`), all at once,
  EOS ignored: speculation configured under load. Target >= 0.95x.

`base` is `LLM(dtype=...)`, `spec` the same with `speculative_config` (`--speculative-config`,
JSON as vLLM takes it); `--sweep-k` adds `spec-kN` systems with other draft lengths. Each
of `--rounds` rounds starts every system's engine afresh in a process of its own, in an order
that rotates, and the systems take turns in that order, so a shared machine's slow spells and
an engine's place (`engine_process.py`: one started earlier can run slower all along) fall on
all alike; a ratio is the median over rounds of the ratio within a round. Output tok/s =
generated tokens / wall time of the whole set. From the engine's counters: the draft
acceptance rate, the mean acceptance length (1 + accepted tokens per draft: tokens a verify
step yields) and per draft position the fraction of drafts whose position i was accepted.

Lossless: greedy outputs with speculation must equal those without, token for token, in
float32, on every prompt of every round (PASS/FAIL); in bfloat16 (on a CPU with
AVX512-BF16) the agreement is reported: prompts identical, and the mean fraction of leading
tokens that match. The dtype the main run does not cover gets one extra pass.

    python -m benchmarks.spec_decode --name spec_decode-avx2
    python -m benchmarks.spec_decode --sweep-k 3,4,6 --speculative-config \\
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, \\
          "prompt_lookup_min": 2}'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from benchmarks.common import (
    corpus_token_ids,
    fmt,
    make_workload,
    markdown_table,
    parse_range,
    verdict,
    write_results,
)
from benchmarks.engine_process import EngineProcess, rotated
from benchmarks.spec_workload import FREE_FORM, GROUNDED, SYSTEM

# k = 5: a verify step's 6 rows are one pass of the CPU float kernel's vector tiles (up to 6
# rows), so it costs what k = 4's 5 rows do (27.1 against 27.4 ms on a Zen 3 EPYC), and it
# measured at or above k = 4 on five of six CPU kinds (benchmarks/README.md, section 11). Lookup
# from one token: drafts for the steps whose last two tokens never occurred (with lookup 2-4,
# 523 of the grounded set's 1,041 decode steps had none; with 1-4, 236), which pays while a
# verify step costs under about 1.4 plain ones (`spec_replay.py`).
DEFAULT_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 5,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
}
TARGETS = {"grounded": 2.0, "free-form": 0.95, "batch": 0.95}  # spec / base output tok/s
SINGLE_STREAM_SETS = ("grounded", "free-form")
# The engine's cumulative speculation counters (`EngineStats`), deltas taken around each run.
COUNTERS = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)
PER_POS = "spec_decode_num_accepted_tokens_per_pos"
WARM_UP_IDS = list(range(1063, 999, -1))  # 64 token ids that no measured prompt starts with


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    add("--speculative-config", type=json.loads, default=DEFAULT_SPEC, help="JSON, as vLLM's")
    add("--sweep-k", default="", help="comma list of other num_speculative_tokens to measure")
    add("--dtype", default="auto", help="float32, bfloat16 or auto (the engine's choice)")
    add("--rounds", type=int, default=2)
    add("--num-prompts", type=int, default=None, help="evenly spaced subset of each chat set")
    add("--max-tokens", type=int, default=None, help="cap on each chat task's max_tokens")
    add("--batch-requests", type=int, default=32)
    add("--input-len", type=parse_range, default=(64, 512), help="batch: LOW:HIGH prompt tokens")
    add("--output-len", type=parse_range, default=(64, 128), help="batch: LOW:HIGH output tokens")
    add("--seed", type=int, default=0)
    # Each engine holds its own pool: 1.5 GiB keeps 32 of the longest batch requests in fp32.
    add("--kv-cache-memory-bytes", type=int, default=3 << 29, help="each engine's KV pool")
    add("--name", default="spec_decode", help="results/<name>.json and .md")
    args = parser.parse_args(argv)
    args.sweep_k = [int(k) for k in args.sweep_k.split(",") if k]
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    return args


# ---------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """One request: its prompt tokens and how it is sampled (greedy)."""

    name: str
    kind: str
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = False

    def sampling_params(self) -> Any:
        from engine import SamplingParams

        return SamplingParams(
            temperature=0.0, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos
        )


def spaced(items: Sequence[Any], n: int | None) -> list[Any]:
    """`n` items evenly spaced over the list: a short run still covers every kind of task."""
    if n is None or n >= len(items):
        return list(items)
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]


def chat_tasks(args: argparse.Namespace, tokenizer: Any, entries: Sequence[dict]) -> list[Task]:
    """The workload's entries as conversations through the chat template."""
    from engine import apply_chat_template

    tasks = []
    for entry in spaced(entries, args.num_prompts):
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": entry["prompt"]},
        ]
        _, token_ids = apply_chat_template(tokenizer, messages)
        max_tokens = min(entry["max_tokens"], args.max_tokens or entry["max_tokens"])
        tasks.append(Task(entry["name"], entry["kind"], token_ids, max_tokens))
    return tasks


def build_sets(args: argparse.Namespace, tokenizer: Any) -> dict[str, list[Task]]:
    batch = make_workload(
        corpus_token_ids(tokenizer), args.batch_requests, args.input_len, args.output_len, args.seed
    )
    return {
        "grounded": chat_tasks(args, tokenizer, GROUNDED),
        "free-form": chat_tasks(args, tokenizer, FREE_FORM),
        "batch": [
            Task(r.request_id, "corpus", r.prompt_token_ids, r.output_len, ignore_eos=True)
            for r in batch
        ],
    }


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


@dataclass
class SetRun:
    """One system's pass over one set: wall time, outputs and speculation counter deltas."""

    seconds: float
    token_ids: list[list[int]]
    counters: dict[str, Any]
    # Single stream only: per task, for the per-kind breakdown.
    task_seconds: list[float] = field(default_factory=list)
    task_counters: list[dict[str, Any]] = field(default_factory=list)
    # Single stream only: wall seconds of each engine step, by kind (`StepTimer`).
    step_seconds: dict[str, list[float]] = field(default_factory=dict)


class StepTimer:
    """Times every step of an engine, split by whether it verified drafts (the engine's draft
    counter moved) or not ("plain": prompts and decode steps without drafts): what a verify
    step costs against a decode step, the figure the speedup turns on."""

    KINDS = ("plain", "verify")

    def __init__(self, llm: Any) -> None:
        self.engine = llm.llm_engine
        self.step = self.engine.step
        self.engine.step = self
        self.seconds: dict[str, list[float]] = {kind: [] for kind in self.KINDS}

    def __call__(self) -> Any:
        drafts = self.engine.get_stats().spec_decode_num_drafts
        start = time.perf_counter()
        outputs = self.step()
        elapsed = time.perf_counter() - start
        verified = self.engine.get_stats().spec_decode_num_drafts > drafts
        self.seconds[self.KINDS[verified]].append(elapsed)
        return outputs

    def take(self) -> dict[str, list[float]]:
        """The steps timed since the last call."""
        taken, self.seconds = self.seconds, {kind: [] for kind in self.KINDS}
        return taken


def read_counters(llm: Any) -> dict[str, Any]:
    stats = llm.llm_engine.get_stats()
    counters = {name: getattr(stats, name) for name in COUNTERS}
    counters[PER_POS] = list(getattr(stats, PER_POS))
    return counters


def counter_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    delta = {name: after[name] - before[name] for name in COUNTERS}
    delta[PER_POS] = [a - b for a, b in zip(after[PER_POS], before[PER_POS], strict=True)]
    return delta


def counter_sum(deltas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    total = {name: sum(d[name] for d in deltas) for name in COUNTERS}
    total[PER_POS] = [sum(column) for column in zip(*(d[PER_POS] for d in deltas), strict=True)]
    return total


def run_single_stream(llm: Any, tasks: Sequence[Task], progress: tqdm) -> SetRun:
    """One request at a time, each after the previous has finished."""
    token_ids, task_seconds, task_counters = [], [], []
    timer = llm.step_timer
    timer.take()
    for task in tasks:
        before = read_counters(llm)
        start = time.perf_counter()
        output = llm.generate([task.prompt_token_ids], task.sampling_params())[0]
        task_seconds.append(time.perf_counter() - start)
        task_counters.append(counter_delta(read_counters(llm), before))
        token_ids.append(list(output.outputs[0].token_ids))
        progress.update(1)
    counters = counter_sum(task_counters)
    return SetRun(sum(task_seconds), token_ids, counters, task_seconds, task_counters, timer.take())


def run_batch(llm: Any, tasks: Sequence[Task], progress: tqdm) -> SetRun:
    """All requests at once, as `throughput.py` runs them."""
    before = read_counters(llm)
    start = time.perf_counter()
    outputs = llm.generate(
        [t.prompt_token_ids for t in tasks], [t.sampling_params() for t in tasks]
    )
    seconds = time.perf_counter() - start
    progress.update(len(tasks))
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    return SetRun(seconds, token_ids, counter_delta(read_counters(llm), before))


def run_set(llm: Any, set_name: str, tasks: Sequence[Task], progress: tqdm) -> SetRun:
    if set_name in SINGLE_STREAM_SETS:
        return run_single_stream(llm, tasks, progress)
    return run_batch(llm, tasks, progress)


def system_configs(args: argparse.Namespace) -> dict[str, dict[str, Any] | None]:
    """System name -> speculative_config (None: no speculation)."""
    systems: dict[str, dict[str, Any] | None] = {"base": None, "spec": args.speculative_config}
    for k in args.sweep_k:
        systems[f"spec-k{k}"] = {**args.speculative_config, "num_speculative_tokens": k}
    return systems


def engine_kwargs(args: argparse.Namespace, dtype: str, spec_config: dict | None) -> dict:
    """A system's `LLM` options (JSON: an `EngineProcess` builds it)."""
    options = {} if spec_config is None else {"speculative_config": spec_config}
    return dict(
        model=args.model, dtype=dtype, kv_cache_memory_bytes=args.kv_cache_memory_bytes, **options
    )


# In each system's process (`engine_process.EngineProcess`): set it up, then run sets.
def setup_engine(llm: Any) -> dict[str, Any]:
    """One-off costs (allocation, kernels) paid on a prompt no measured one shares; the step
    timer; the dtype the engine chose and the batch size it stops speculating at."""
    llm.generate([WARM_UP_IDS], Task("warm-up", "-", WARM_UP_IDS, 16).sampling_params())
    llm.step_timer = StepTimer(llm)
    runner = llm.llm_engine.engine_core.model_runner
    return {
        "dtype": str(runner.dtype).removeprefix("torch."),
        "disable_by_batch_size": runner.disable_by_batch_size,
    }


class _NoProgress:
    def update(self, n: int) -> None:
        pass


def run_set_in_process(llm: Any, set_name: str, tasks: list[dict]) -> dict:
    return asdict(run_set(llm, set_name, [Task(**t) for t in tasks], _NoProgress()))


def measure(
    args: argparse.Namespace,
    systems: dict[str, dict | None],
    dtype: str,
    sets: dict[str, list[Task]],
    rounds: int,
    desc: str,
) -> tuple[dict[str, dict[str, list[SetRun]]], str]:
    """runs[set][system]: one SetRun per round, and the dtype the engines ran. Every round
    starts each system's engine afresh, in a process of its own, in an order that rotates
    (`engine_process`: an engine started earlier than another can run slower all along)."""
    names = list(systems)
    runs = {s: {n: [] for n in names} for s in sets}
    jobs = {s: [asdict(t) for t in tasks] for s, tasks in sets.items()}
    total = rounds * len(names) * sum(len(t) for t in sets.values())
    with tqdm(total=total, desc=desc, unit="req") as progress:
        for r in range(rounds):
            order = rotated(names, r)
            with contextlib.ExitStack() as stack:
                engines = {}
                for name in order:
                    progress.set_postfix_str(f"round {r + 1} starting {name}")
                    engines[name] = stack.enter_context(
                        EngineProcess(
                            __file__, engine_kwargs(args, dtype, systems[name]), "setup_engine"
                        )
                    )
                for set_name, tasks in sets.items():
                    for name in order:
                        progress.set_postfix_str(f"round {r + 1} {set_name} {name}")
                        result = engines[name].call("run_set_in_process", set_name, jobs[set_name])
                        runs[set_name][name].append(SetRun(**result))
                        progress.update(len(tasks))
                ready = {name: engines[name].ready for name in names}
    return runs, ready


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------


def tokens_of(run: SetRun) -> int:
    return sum(len(ids) for ids in run.token_ids)


def speed_summary(runs: dict[str, list[SetRun]]) -> dict[str, dict[str, Any]]:
    """Per system: output tok/s per round, their median, and the median ratio to base."""
    base = [tokens_of(r) / r.seconds for r in runs["base"]]
    summary = {}
    for name, system_runs in runs.items():
        rates = [tokens_of(r) / r.seconds for r in system_runs]
        summary[name] = {
            "output_tokens": [tokens_of(r) for r in system_runs],
            "seconds": [r.seconds for r in system_runs],
            "output_tok_s": rates,
            "median_output_tok_s": statistics.median(rates),
            "ratio_per_round": [a / b for a, b in zip(rates, base, strict=True)],
        }
        summary[name]["ratio"] = statistics.median(summary[name]["ratio_per_round"])
    return summary


def step_summary(runs: dict[str, list[SetRun]]) -> dict[str, dict[str, Any]]:
    """Per system, over all rounds: count and median wall ms of plain and verify steps."""
    summary = {}
    for name, system_runs in runs.items():
        summary[name] = {}
        for kind in StepTimer.KINDS:
            seconds = [t for r in system_runs for t in r.step_seconds[kind]]
            summary[name][kind] = {
                "steps": len(seconds),
                "median_ms": 1e3 * statistics.median(seconds) if seconds else None,
            }
    return summary


def acceptance(counters: dict[str, Any]) -> dict[str, Any]:
    """Rates from summed counters: per draft token, per draft, per draft position."""
    drafts = counters["spec_decode_num_drafts"]
    accepted = counters["spec_decode_num_accepted_tokens"]
    draft_tokens = counters["spec_decode_num_draft_tokens"]
    return {
        **counters,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_rate": [n / drafts for n in counters[PER_POS]] if drafts else [],
    }


def acceptance_summary(
    runs: dict[str, list[SetRun]], systems: dict[str, dict | None]
) -> dict[str, dict[str, Any]]:
    return {
        name: acceptance(counter_sum([r.counters for r in runs[name]]))
        for name in runs
        if systems[name] is not None
    }


def per_kind_summary(
    runs: dict[str, list[SetRun]], tasks: Sequence[Task], systems: dict[str, dict | None]
) -> dict[str, dict[str, Any]]:
    """Per kind of task (copy, code, ...) and spec system: tok/s ratio to base, acceptance."""
    summary = {}
    for kind in dict.fromkeys(t.kind for t in tasks):
        idx = [i for i, t in enumerate(tasks) if t.kind == kind]

        def rate(name: str, idx: list[int] = idx) -> float:
            tokens = sum(len(r.token_ids[i]) for r in runs[name] for i in idx)
            return tokens / sum(r.task_seconds[i] for r in runs[name] for i in idx)

        summary[kind] = {
            name: {
                "ratio": rate(name) / rate("base"),
                **acceptance(counter_sum([r.task_counters[i] for r in runs[name] for i in idx])),
            }
            for name, config in systems.items()
            if config is not None
        }
    return summary


def leading_match(a: Sequence[int], b: Sequence[int]) -> float:
    """Fraction of the longer output that both share from the start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n / max(len(a), len(b), 1)


def agreement(runs: dict[str, list[SetRun]]) -> dict[str, dict[str, Any]]:
    """Per spec system: how its outputs match base's, over every prompt of every round."""
    summary = {}
    for name, system_runs in runs.items():
        if name == "base":
            continue
        pairs = [
            (a, b)
            for spec_run, base_run in zip(system_runs, runs["base"], strict=True)
            for a, b in zip(spec_run.token_ids, base_run.token_ids, strict=True)
        ]
        summary[name] = {
            "outputs": len(pairs),
            "identical": sum(a == b for a, b in pairs) / len(pairs),
            "mean_leading_match": statistics.mean(leading_match(a, b) for a, b in pairs),
        }
    return summary


def agreement_pass(
    args: argparse.Namespace, dtype: str, sets: dict[str, list[Task]]
) -> dict[str, dict[str, Any]]:
    """base and spec in `dtype`, one round: the dtype the main run did not cover."""
    systems = {"base": None, "spec": args.speculative_config}
    runs, _ = measure(args, systems, dtype, sets, 1, f"agreement {dtype}")
    return {set_name: agreement(set_runs) for set_name, set_runs in runs.items()}


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def ratio_cell(value: float) -> str:
    return f"{value:.2f}x"


def speed_rows(speed: dict[str, dict[str, dict[str, Any]]]) -> list[list[str]]:
    rows = []
    for set_name, systems in speed.items():
        for name, s in systems.items():
            target = TARGETS[set_name] if name == "spec" else None
            rows.append(
                [
                    set_name,
                    name,
                    str(s["output_tokens"][0]),
                    fmt(statistics.median(s["seconds"])),
                    fmt(s["median_output_tok_s"]),
                    "-" if name == "base" else ratio_cell(s["ratio"]),
                    ", ".join(ratio_cell(r) for r in s["ratio_per_round"])
                    if name != "base"
                    else "-",
                    f">= {target:g}x" if target else "-",
                    verdict(s["ratio"], target) if target else "-",
                ]
            )
    return rows


def acceptance_row(label: Sequence[str], a: dict[str, Any]) -> list[str]:
    return [
        *label,
        str(a["spec_decode_num_drafts"]),
        str(a["spec_decode_num_draft_tokens"]),
        str(a["spec_decode_num_accepted_tokens"]),
        fmt(a["acceptance_rate"], 3),
        fmt(a["mean_acceptance_length"], 2),
        " / ".join(f"{r:.2f}" for r in a["per_position_rate"]) or "-",
    ]


ACCEPTANCE_HEADERS = [
    "drafts",
    "draft tokens",
    "accepted",
    "acceptance rate",
    "mean acceptance length",
    "accepted at position 1 / 2 / ...",
]


def step_rows(steps: dict[str, dict[str, dict[str, dict[str, Any]]]]) -> list[list[str]]:
    rows = []
    for set_name, systems in steps.items():
        base_plain = systems["base"]["plain"]["median_ms"]
        for name, s in systems.items():
            plain, verify = s["plain"], s["verify"]
            rows.append(
                [
                    set_name,
                    name,
                    str(plain["steps"]),
                    fmt(plain["median_ms"], 1),
                    str(verify["steps"]),
                    fmt(verify["median_ms"], 1),
                    ratio_cell(verify["median_ms"] / base_plain) if verify["steps"] else "-",
                ]
            )
    return rows


def agreement_rows(
    agreements: dict[str, dict[str, dict[str, dict[str, Any]]]],
) -> list[list[str]]:
    rows = []
    for dtype, sets in agreements.items():
        for set_name, systems in sets.items():
            for name, a in systems.items():
                lossless = dtype == "float32"
                rows.append(
                    [
                        dtype,
                        set_name,
                        name,
                        str(a["outputs"]),
                        f"{a['identical']:.1%}",
                        f"{a['mean_leading_match']:.1%}",
                        "100% identical" if lossless else "reported",
                        verdict(a["identical"], 1.0) if lossless else "-",
                    ]
                )
    return rows


def report(args: argparse.Namespace, results: dict[str, Any]) -> str:
    sets = results["sets"]
    lines = [
        "# Speculative decoding",
        "",
        f"`speculative_config` {json.dumps(args.speculative_config)}"
        f" (`disable_by_batch_size` as run: {fmt_limits(results['disable_by_batch_size'])});"
        f" dtype {results['dtype']};"
        f" {args.rounds} rounds, systems taking turns; ratios are medians over rounds of"
        " spec / base output tok/s within a round. Single stream: grounded"
        f" {sets['grounded']} and free-form {sets['free-form']} chat tasks (`spec_workload.py`),"
        f" one at a time, greedy, stopping at EOS. Batch: {sets['batch']} corpus windows,"
        f" inputs {args.input_len[0]}-{args.input_len[1]}, outputs {args.output_len[0]}-"
        f"{args.output_len[1]} tokens, all at once, EOS ignored.",
        "",
        "## Output tok/s",
        "",
        markdown_table(
            [
                "set",
                "system",
                "output tokens (round 1)",
                "s (median)",
                "output tok/s",
                "spec / base",
                "per round",
                "target",
                "verdict",
            ],
            speed_rows(results["speed"]),
        ),
        "",
        "## Acceptance",
        "",
        "Mean acceptance length: tokens a verify step yields, 1 + accepted tokens per draft.",
        "",
        markdown_table(
            ["set", "system", *ACCEPTANCE_HEADERS],
            [
                acceptance_row([set_name, name], a)
                for set_name, systems in results["acceptance"].items()
                for name, a in systems.items()
            ],
        ),
        "",
        "## Step times (single stream)",
        "",
        "Wall time of each engine step, medians over every round. Plain steps verify no drafts"
        " (prompts, and decode steps where the proposer found nothing); verify steps score a"
        " request's drafts and one more token.",
        "",
        markdown_table(
            [
                "set",
                "system",
                "plain steps",
                "plain ms",
                "verify steps",
                "verify ms",
                "verify / base plain",
            ],
            step_rows(results["steps"]),
        ),
        "",
        "## Per kind of task (single stream)",
        "",
        markdown_table(
            ["kind", "system", "spec / base", *ACCEPTANCE_HEADERS],
            [
                acceptance_row([kind, name, ratio_cell(a["ratio"])], a)
                for kind, systems in results["per_kind"].items()
                for name, a in systems.items()
            ],
        ),
        "",
        "## Agreement with base (greedy, token for token)",
        "",
        markdown_table(
            [
                "dtype",
                "set",
                "system",
                "outputs",
                "identical",
                "mean leading match",
                "target",
                "verdict",
            ],
            agreement_rows(results["agreement"]),
        ),
    ]
    lines += [""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(lines)


def fmt_limits(limits: dict[str, int | None]) -> str:
    """Each speculating system's `disable_by_batch_size` as it ran: `8`, or `8 (spec), None
    (spec-k3)` where they differ."""
    text = {name: str(n) for name, n in limits.items()}
    if len(set(text.values())) == 1:
        return next(iter(text.values()))
    return ", ".join(f"{t} ({name})" for name, t in text.items())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine import load_tokenizer, resolve_model
    from engine.kernels.cpu_build import cpu_bf16_unit

    sets = build_sets(args, load_tokenizer(resolve_model(args.model)))
    systems = system_configs(args)
    runs, ready = measure(args, systems, args.dtype, sets, args.rounds, "spec decode")
    dtype = ready["base"]["dtype"]
    results: dict[str, Any] = {
        "dtype": dtype,
        # per speculating system: steps of this many requests or more propose nothing
        "disable_by_batch_size": {
            name: r["disable_by_batch_size"] for name, r in ready.items() if systems[name]
        },
        "sets": {name: len(tasks) for name, tasks in sets.items()},
        "speed": {s: speed_summary(r) for s, r in runs.items()},
        "acceptance": {s: acceptance_summary(r, systems) for s, r in runs.items()},
        "steps": {s: step_summary(runs[s]) for s in SINGLE_STREAM_SETS},
        "per_kind": {
            **per_kind_summary(runs["grounded"], sets["grounded"], systems),
            **per_kind_summary(runs["free-form"], sets["free-form"], systems),
        },
        "agreement": {dtype: {s: agreement(r) for s, r in runs.items()}},
        "notes": [],
    }
    if dtype != "float32":
        results["agreement"]["float32"] = agreement_pass(args, "float32", sets)
    if dtype != "bfloat16":
        if cpu_bf16_unit() is not None:
            results["agreement"]["bfloat16"] = agreement_pass(args, "bfloat16", sets)
        else:
            results["notes"].append("bfloat16 agreement skipped: this CPU lacks AVX512-BF16.")
    payload = {"args": vars(args), **results}
    write_results(args.name, payload, report(args, results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
