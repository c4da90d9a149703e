"""Features in combination: random engine configurations and request mixes (hypothesis).

Each feature has tests of its own; these check that they compose. An engine draws W8A8 or
not, an fp8 cache or not, the `torch` or the `cpu` attention backend, CPU graphs or eager
steps, prefix caching on or off, a token budget small enough to chunk prompts, a KV pool
small enough to preempt, FCFS or priority scheduling, and ngram or draft-model speculation or
none; its requests mix n > 1, sampling with and without seeds, penalties, logit bias, stop
strings and stop ids, min_tokens, logprobs, prompt logprobs and structured outputs. Every
request must keep its contract (its choices, a finish reason, no more than max_tokens, exactly
max_tokens when nothing can stop it, logprobs for every token), greedy float32 outputs must
equal a plain engine's token for token, and interleavings of adds, aborts, session turns and
beam searches must leave nothing running and the KV pool fully free.

Examples are derandomized, so CI runs the same ones every time; `derandomize=False` (and
`--hypothesis-seed=N`) explores others: a session's random exploration of the same space,
about 400 engines, found nothing to fix. Breaking what a test guards makes it fail, e.g.
EOS and stop ids no longer held back until min_tokens (both the sampler's mask and the
scheduler's check), or a closed session's KV left allocated.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from engine import LLM, BeamSearchParams, SamplingParams
from engine.structured_outputs import StructuredOutputsParams
from tests.engine.test_llm import assert_pool_free
from tests.engine.tiny_models import make_tiny_model

# No shrinking: an engine per example makes it take minutes; a failure prints its example as
# drawn (`note`), which reproduces it.
SETTINGS = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MAX_MODEL_LEN = 256
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fib(n):\n    return",
    "List three colors: red, green,",
    "Once upon a time " * 12,
    "1, 2, 3, 4, 5, 6,",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3,
]
STRUCTURED = [
    StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
    StructuredOutputsParams(regex=r"[0-9]{2,4}-[a-z]+"),
    StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    ),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("combinations")
    target = make_tiny_model(root / "target", "llama")
    draft = make_tiny_model(root / "draft", "llama", seed=1, num_hidden_layers=1)
    return str(target), str(draft)


@st.composite
def engine_options(draw, float32: bool = False) -> dict:
    """Engine keywords, less the model and the draft model's path (`"draft"` stands for it)."""
    block_size = draw(st.sampled_from([8, 16]))
    options = dict(
        dtype="float32" if float32 else draw(st.sampled_from(["float32", "bfloat16"])),
        quantization=None if float32 else draw(st.sampled_from([None, "int8"])),
        kv_cache_dtype="auto" if float32 else draw(st.sampled_from(["auto", "fp8"])),
        attention_backend=draw(st.sampled_from(["torch", "cpu"])),
        enforce_eager=draw(st.booleans()),
        enable_prefix_caching=draw(st.booleans()),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        max_num_seqs=draw(st.sampled_from([2, 4, 32])),
        max_num_batched_tokens=draw(st.sampled_from([16, 64, 2048])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 8])),
        block_size=block_size,
        max_model_len=MAX_MODEL_LEN,
        # one request's worth (preemptions), or room for several
        num_kv_blocks=draw(st.sampled_from([1, 4])) * MAX_MODEL_LEN // block_size,
    )
    method = draw(st.sampled_from([None, "ngram", "draft_model"]))
    if method is not None:
        k = draw(st.integers(1, 5))
        disable = draw(st.sampled_from([None, "auto", 3]))
        spec = dict(method=method, num_speculative_tokens=k, disable_by_batch_size=disable)
        if method == "ngram":
            spec.update(prompt_lookup_min=draw(st.integers(1, 2)), prompt_lookup_max=4)
        else:
            spec["model"] = "draft"
        options["speculative_config"] = spec
    return options


def build(models: tuple[str, str], options: dict, **example) -> LLM:
    """The engine of `options`; notes the example, printed if the test fails."""
    note(f"engine options: {options}")
    for name, value in example.items():
        note(f"{name}: {value}")
    target, draft = models
    spec = options.get("speculative_config")
    if spec is not None and spec["method"] == "draft_model":
        options = {**options, "speculative_config": {**spec, "model": draft}}
    return LLM(target, **options)


@st.composite
def sampling_options(draw, allow_n: bool = True) -> dict:
    max_tokens = draw(st.sampled_from([1, 5, 17, 40]))
    options: dict = dict(max_tokens=max_tokens, ignore_eos=draw(st.booleans()))
    if draw(st.booleans()):
        options["temperature"] = 0.0
    else:
        options["temperature"] = draw(st.sampled_from([0.5, 1.0, 1.5]))
        options["top_p"] = draw(st.sampled_from([1.0, 0.9, 1e-30]))
        options["top_k"] = draw(st.sampled_from([-1, 1, 50]))
        options["seed"] = draw(st.none() | st.integers(0, 2**20))
        if allow_n:
            options["n"] = draw(st.sampled_from([1, 1, 3]))
    for name, values in (
        ("min_tokens", [0, max_tokens]),
        ("stop", [[], ["e"], [" the", "\n"]]),
        ("stop_token_ids", [[], [1000]]),
        ("presence_penalty", [0.0, 1.5]),
        ("frequency_penalty", [0.0, -0.5]),
        ("repetition_penalty", [1.0, 1.3]),
        ("logprobs", [None, 0, 3]),
        ("prompt_logprobs", [None, 2]),
        # forcing a stop id, or EOS (the tiny models' is 2), makes min_tokens count
        ("logit_bias", [None, {1000: 100.0}, {1000: -100.0}, {2: 100.0}]),
        ("structured_outputs", [None, None, *STRUCTURED]),
    ):
        options[name] = draw(st.sampled_from(values))
    return options


def can_stop_early(options: dict) -> bool:
    return bool(
        not options["ignore_eos"]
        or options["stop"]
        or options["stop_token_ids"]
        or options["structured_outputs"]
    )


def assert_contract(output, options: dict) -> None:
    """What any request must get back, whatever else ran beside it."""
    assert output.error is None and output.finished
    assert len(output.outputs) == options.get("n", 1)
    for completion in output.outputs:
        num_tokens = len(completion.token_ids)
        assert completion.finish_reason in ("stop", "length")
        assert num_tokens <= options["max_tokens"]
        if not can_stop_early(options):
            assert (num_tokens, completion.finish_reason) == (options["max_tokens"], "length")
        if not options["stop"] and options["structured_outputs"] is None:
            assert num_tokens >= options["min_tokens"]  # EOS and stop ids wait for it
        if options["logprobs"] is not None:
            assert len(completion.logprobs) == num_tokens
            for token_id, top in zip(completion.token_ids, completion.logprobs, strict=True):
                assert token_id in top and len(top) >= options["logprobs"]
    if options["prompt_logprobs"] is not None:
        assert len(output.prompt_logprobs) == len(output.prompt_token_ids)
        assert output.prompt_logprobs[0] is None


@SETTINGS
@given(
    options=engine_options(),
    requests=st.lists(
        st.tuples(st.sampled_from(PROMPTS), sampling_options(), st.integers(-2, 2)),
        min_size=1,
        max_size=8,
    ),
)
def test_every_request_keeps_its_contract_in_any_configuration(models, options, requests):
    llm = build(models, options, requests=requests)
    prompts, params, priorities = zip(*requests, strict=True)
    if options["scheduling_policy"] == "fcfs":
        priorities = None
    outputs = llm.generate(
        list(prompts), [SamplingParams(**p) for p in params], priority=priorities
    )
    for output, p in zip(outputs, params, strict=True):
        assert_contract(output, p)
    assert_pool_free(llm)


@pytest.fixture(scope="module")
def plain(models):
    """Float32, no speculation, no prefix caching, eager steps, every prompt in one step."""
    return LLM(
        models[0],
        dtype="float32",
        attention_backend="torch",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_batched_tokens=4096,
        max_model_len=MAX_MODEL_LEN,
    )


@SETTINGS
@given(
    options=engine_options(float32=True),
    requests=st.lists(
        st.tuples(
            st.sampled_from(PROMPTS),
            st.fixed_dictionaries(
                dict(
                    temperature=st.just(0.0),
                    max_tokens=st.sampled_from([3, 17, 40]),
                    ignore_eos=st.booleans(),
                    presence_penalty=st.sampled_from([0.0, 1.5]),
                    repetition_penalty=st.sampled_from([1.0, 1.3]),
                    stop=st.sampled_from([[], ["e"]]),
                    logit_bias=st.sampled_from([None, {1000: 100.0}]),
                )
            ),
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_greedy_float32_outputs_equal_a_plain_engine_s(models, plain, options, requests):
    llm = build(models, options, requests=requests)
    prompts = [prompt for prompt, _ in requests]
    params = [SamplingParams(**p) for _, p in requests]
    ours = llm.generate(prompts, params)
    theirs = plain.generate(prompts, params)
    for a, b in zip(ours, theirs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert (a.outputs[0].text, a.outputs[0].finish_reason) == (
            b.outputs[0].text,
            b.outputs[0].finish_reason,
        )
    assert_pool_free(llm)
    assert_pool_free(plain)


# One engine-level operation: add a request of a kind, abort one, or step.
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), sampling_options(allow_n=True)),
        st.tuples(st.just("open session"), sampling_options(allow_n=False)),
        st.tuples(st.just("next turn"), sampling_options(allow_n=False), st.booleans()),
        st.tuples(
            st.just("beam search"), st.integers(1, 3), st.sampled_from([2, 9]), st.booleans()
        ),
        st.tuples(st.just("abort"), st.integers(0, 100)),
        st.tuples(st.just("step"), st.integers(1, 8)),
    ),
    max_size=30,
)


@SETTINGS
@given(options=engine_options(), ops=operations, drain_steps=st.integers(0, 20))
def test_adds_aborts_sessions_and_beam_searches_leave_nothing_behind(
    models, options, ops, drain_steps
):
    llm = build(models, options, ops=ops, drain_steps=drain_steps)
    engine = llm.llm_engine
    tokenizer = engine.tokenizer
    live: list[str] = []  # ids added and not seen finished
    waiting_sessions: list[str] = []  # sessions between turns
    for i, (kind, *args) in enumerate(ops):
        request_id = f"r{i}"
        prompt = tokenizer.encode(PROMPTS[i % len(PROMPTS)])
        if kind == "add":
            engine.add_request(request_id, prompt, SamplingParams(**args[0]))
        elif kind == "open session":
            engine.add_request(request_id, prompt, SamplingParams(**args[0]), resumable=True)
        elif kind == "next turn":
            if not waiting_sessions:
                continue
            request_id = waiting_sessions.pop(0)
            engine.add_request(
                request_id, tokenizer.encode(" and then"), SamplingParams(**args[0]),
                resumable=args[1],
            )  # fmt: skip
        elif kind == "beam search":
            width, max_tokens, ignore_eos = args
            engine.add_request(request_id, prompt, BeamSearchParams(width, max_tokens, ignore_eos))
        elif kind == "abort":
            if live or waiting_sessions:
                victims = live + waiting_sessions
                victim = victims[args[0] % len(victims)]
                engine.abort_request(victim)
                for ids in (live, waiting_sessions):
                    if victim in ids:
                        ids.remove(victim)
            continue
        else:
            for _ in range(args[0]):
                for output in engine.step():
                    if output.request_id not in live:
                        continue
                    if output.finished:
                        live.remove(output.request_id)
                    elif all(c.finish_reason is not None for c in output.outputs):
                        live.remove(output.request_id)  # a session's turn ended
                        waiting_sessions.append(output.request_id)
            continue
        live.append(request_id)
    for _ in range(drain_steps):
        engine.step()
    aborted = engine.abort_all()
    assert set(aborted) <= {*live, *waiting_sessions}
    assert not engine.has_unfinished_requests()
    assert all(engine.get_session_token_ids(f"r{i}") is None for i in range(len(ops)))
    assert_pool_free(llm)
