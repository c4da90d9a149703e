"""Issue 14, items 4 and 5: the OpenAI API's strictness and its compatibility defects.

Unknown fields are refused (or, configured so, logged and ignored); batched prompts, echo
with prompt logprobs (lm-eval-harness's log-likelihoods), the chat template options, chat
`top_logprobs` and the logprobs' `bytes` behave as OpenAI and vLLM have them. Against a real
`Worker` on the tiny random-weight model and the offline engine, or, where only what the API
sends matters, the fake worker of `test_api`; always a real Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from structlog.testing import capture_logs
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from engine import LLM, SamplingParams, TokenBytes, apply_chat_template
from engine.loader import load_tokenizer, resolve_model
from queueing.schema import keys
from service.api import create_app
from service.cli import build_parser, settings_of
from service.openai_protocol import ParseContext, RequestBody, parse_chat, parse_completion
from service.openapi import openapi_document
from service.settings import Settings, SettingsError
from tests.service.conftest import ENGINE_KWARGS
from tests.service.test_api import MODEL, Api, FakeWorker, assert_error, parse_sse
from tests.service.test_resume import aborts
from tests.service.test_worker import GREEDY, PROMPT, hold_steps, serving

pytestmark = pytest.mark.timeout(120)

TINY = "tiny"
CHAT = [{"role": "user", "content": "Hi"}]
SMOLLM2 = resolve_model(None)


@contextlib.asynccontextmanager
async def api(redis_url: str, name: str, tokenizer_dir, **settings):
    """An API app on the test's Redis: its HTTP client."""
    app = create_app(redis_url, name, tokenizer_dir, Settings(**settings), worker_cache_s=0.0)
    async with Api(app) as running, httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        yield http


@pytest_asyncio.fixture
async def fake(redis_url):
    worker = await FakeWorker(redis_url).start()
    yield worker
    await worker.stop()


@pytest_asyncio.fixture
async def http(redis_url, fake):
    """The API (SmolLM2's tokenizer) before the fake worker: it sees what the API sends."""
    async with api(redis_url, MODEL, SMOLLM2) as client:
        yield client


@pytest_asyncio.fixture
async def real(engine, model_dir, redis_url):
    """The API and a real worker on the tiny model."""
    async with serving(engine, redis_url), api(redis_url, TINY, model_dir) as client:
        yield client


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model=model_dir, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(SMOLLM2)


def sse_events(text: str) -> tuple[list[str], list[dict]]:
    """A stream's event ids (those it has) and JSON events, [DONE] left out."""
    blocks = text.strip().split("\n\n")
    assert blocks[-1] == "data: [DONE]"
    ids = [line[4:] for line in text.split("\n") if line.startswith("id: ")]
    return ids, [json.loads(b.split("data: ", 1)[1]) for b in blocks[:-1]]


async def until(condition, what: str, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if await condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not {what} within {timeout_s} s")


# ---- item 4: strictness ------------------------------------------------------------------------


COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT_BODY = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
ENDPOINTS = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT_BODY)]


@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
async def test_an_unknown_field_is_400_naming_it(http, fake, path, body):
    error = assert_error(await http.post(path, json={**body, "temprature": 0.5}), 400)
    assert error == {
        "message": "Unknown parameter: 'temprature'.",
        "type": "invalid_request_error",
        "param": "temprature",
        "code": "unknown_parameter",
    }
    two = assert_error(await http.post(path, json={**body, "a": 1, "user": "u"}), 400, "a")
    assert "'a', 'user'" in two["message"]
    assert not fake.requests  # refused before anything was submitted


@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
async def test_warn_mode_logs_unknown_fields_and_ignores_them(redis_url, fake, path, body):
    async with api(redis_url, MODEL, SMOLLM2, unknown_fields="warn") as lenient:
        with capture_logs() as logs:
            response = await lenient.post(path, json={**body, "temprature": 0.5})
        assert response.status_code == 200, response.text
        # The fields of features not served are refused all the same: never "unknown".
        field = "suffix" if path == "/v1/completions" else "audio"
        assert_error(await lenient.post(path, json={**body, field: {"x": 1}}), 400, field)
    assert [e["fields"] for e in logs if e["event"] == "unknown request fields ignored"] == [
        ["temprature"]
    ]
    assert "temprature" not in fake.requests[0].sampling


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("path", "body", "field", "value", "why"),
    [
        ("/v1/chat/completions", CHAT_BODY, "audio", {"format": "wav"}, "not supported yet"),
        ("/v1/completions", COMPLETION, "suffix", "x", "not supported yet"),
        ("/v1/chat/completions", CHAT_BODY, "functions", [{"name": "f"}], "use 'tools'"),
        ("/v1/chat/completions", CHAT_BODY, "function_call", "auto", "use 'tools'"),
    ],
)
async def test_fields_not_served_are_400s_naming_them(http, path, body, field, value, why):
    error = assert_error(await http.post(path, json={**body, field: value}), 400, field)
    assert why in error["message"] and error["code"] is None


def test_the_known_fields_are_what_the_parsers_read_and_the_document_lists(smollm2):
    """One list: a parser reads each field it knows, whatever the body holds; the OpenAPI
    document lists exactly those."""
    context = ParseContext(MODEL, len(smollm2), frozenset(), "reject")
    schemas = openapi_document(MODEL)["components"]["schemas"]
    for parse, body, schema in [
        (parse_completion, {"model": MODEL, "prompt": "x"}, "CompletionRequest"),
        (parse_chat, {"model": MODEL, "messages": CHAT}, "ChatCompletionRequest"),
    ]:
        read = RequestBody(body)
        parse(read, context)
        assert read.read == set(schemas[schema]["properties"]), schema
        assert schemas[schema]["additionalProperties"] is False


def test_the_document_says_what_the_parsers_accept(smollm2):
    """Before: roles system/user/assistant only (the parser took any), best_of null only (the
    parser takes best_of = n), and an SSE `retry` field the server never sends."""
    context = ParseContext(MODEL, len(smollm2), frozenset(), "reject")
    schemas = openapi_document(MODEL)["components"]["schemas"]
    roles = schemas["ChatCompletionRequest"]["properties"]["messages"]["items"]["properties"]
    for role in roles["role"]["enum"]:
        message = {"role": role, "content": "x"} | ({"tool_call_id": "c"} if role == "tool" else {})
        parse_chat(RequestBody({"model": MODEL, "messages": [message]}), context)
    assert set(roles["role"]["enum"]) == {"system", "developer", "user", "assistant", "tool"}
    best_of = schemas["CompletionRequest"]["properties"]["best_of"]
    assert {"type": "integer", "minimum": 1} in best_of["anyOf"]
    parse_completion(RequestBody({"model": MODEL, "prompt": "x", "n": 2, "best_of": 2}), context)
    event = openapi_document(MODEL)["paths"]["/v1/completions"]["post"]["responses"]["200"]
    assert set(event["content"]["text/event-stream"]["schema"]["properties"]) == {
        "data",
        "id",
        "event",
    }


def test_the_setting_comes_from_the_environment_or_the_flag(monkeypatch):
    assert Settings().unknown_fields == "reject"
    assert Settings.from_env({"KVRAIL_UNKNOWN_FIELDS": "WARN"}).unknown_fields == "warn"
    with pytest.raises(SettingsError, match="KVRAIL_UNKNOWN_FIELDS must be one of reject, warn"):
        Settings.from_env({"KVRAIL_UNKNOWN_FIELDS": "ignore"})
    monkeypatch.setenv("KVRAIL_UNKNOWN_FIELDS", "reject")
    for command in ("api", "serve"):
        args = build_parser().parse_args([command, "--unknown-fields", "warn"])
        assert settings_of(args).unknown_fields == "warn"
    assert settings_of(build_parser().parse_args(["api"])).unknown_fields == "reject"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["api", "--unknown-fields", "ignore"])


# ---- item 5: chat top_logprobs -----------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("top", [1, 3])
async def test_chat_top_logprobs_are_the_k_most_likely_tokens(real, offline, top):
    """Before: k - 1 entries when the sampled token was among the top k (top_logprobs=1
    gave [] when greedy)."""
    tokenizer = offline.get_tokenizer()
    sampled_rank_above_top = []  # per position: the sampled token is not among the top k
    for sampling in (dict(temperature=0.0), dict(temperature=3.0, seed=7)):
        sampling |= dict(max_tokens=6, ignore_eos=True)
        body = {"model": TINY, "messages": CHAT, "logprobs": True, "top_logprobs": top}
        answer = (await real.post("/v1/chat/completions", json={**body, **sampling})).json()
        content = answer["choices"][0]["logprobs"]["content"]
        (expected,) = offline.chat(CHAT, SamplingParams(logprobs=top, **sampling))
        completion = expected.outputs[0]
        assert [e["token"] for e in content] == [
            tokenizer.decode([t]) for t in completion.token_ids
        ]
        for entry, token_id, position in zip(
            content, completion.token_ids, completion.logprobs, strict=True
        ):
            ranked = sorted((lp.rank, t) for t, lp in position.items() if lp.rank <= top)
            assert [e["token"] for e in entry["top_logprobs"]] == [
                tokenizer.decode([t]) for _, t in ranked
            ]
            for got, (_, t) in zip(entry["top_logprobs"], ranked, strict=True):
                assert got["logprob"] == pytest.approx(position[t].logprob, abs=1e-4)
            sampled_rank_above_top.append(position[token_id].rank > top)
    assert any(sampled_rank_above_top) and not all(sampled_rank_above_top)  # both cases


# ---- item 5: batched prompts -------------------------------------------------------------------


BATCH = ["The quick brown fox", "Once upon a time"]


@pytest.mark.asyncio
async def test_a_batch_of_prompts_is_one_engine_request_each(real, offline, redis_url):
    """Before: "'prompt' must be an array of non-negative integers"."""
    tokenizer = offline.get_tokenizer()
    expected = offline.generate(BATCH, SamplingParams(max_tokens=4, **GREEDY))
    body = {"model": TINY, "prompt": BATCH, "max_tokens": 4, "n": 2, **GREEDY}
    answer = (await real.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in answer["choices"]] == [
        out.outputs[0].text for out in expected for _ in range(2)
    ]
    prompt_tokens = sum(len(tokenizer(p).input_ids) for p in BATCH)
    assert answer["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 2 * 2 * 4,
        "total_tokens": prompt_tokens + 16,
        "prompt_tokens_details": {"cached_tokens": 0},  # two prompts, no block in common
    }
    r = aioredis.Redis.from_url(redis_url)
    assert [await r.exists(keys.response(f"{answer['id']}-{p}")) for p in (0, 1)] == [1, 1]
    await r.aclose()
    # Token-id prompts too, and one prompt in an array is one prompt.
    ids = [tokenizer(p).input_ids for p in BATCH]
    by_ids = (await real.post("/v1/completions", json={**body, "prompt": ids, "n": 1})).json()
    assert [c["text"] for c in by_ids["choices"]] == [out.outputs[0].text for out in expected]
    one = (await real.post("/v1/completions", json={**body, "prompt": BATCH[:1]})).json()
    assert [c["index"] for c in one["choices"]] == [0, 1]


@pytest.mark.asyncio
async def test_a_streamed_batch_numbers_its_choices_and_resumes_per_prompt(real, offline):
    expected = offline.generate(BATCH, SamplingParams(max_tokens=5, **GREEDY))
    body = {"model": TINY, "prompt": BATCH, "max_tokens": 5, "stream": True, **GREEDY}
    body["stream_options"] = {"include_usage": True}
    ids, events = sse_events((await real.post("/v1/completions", json=body)).text)

    def texts(chunks) -> dict[int, str]:
        joined: dict[int, str] = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                joined[choice["index"]] = joined.get(choice["index"], "") + choice["text"]
        return joined

    assert texts(events) == {p: out.outputs[0].text for p, out in enumerate(expected)}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 10
    # An event's id is each prompt's last seq sent, joined by ".".
    seqs = [[int(s) for s in i.split(".")] for i in ids]
    assert sorted(seqs[0]) == [-1, 0]  # the first chunk, of one prompt
    assert all(a <= b for x, y in itertools.pairwise(seqs) for a, b in zip(x, y, strict=True))
    assert all(sum(y) == sum(x) + 1 for x, y in itertools.pairwise(seqs))  # one chunk each
    # Resuming after the 4th chunk event gives exactly what came after it, prompt by prompt.
    request_id, cut = events[0]["id"], 3
    resumed = await real.get(f"/v1/streams/{request_id}", headers={"Last-Event-ID": ids[cut]})
    _, after = sse_events(resumed.text)
    before = [e for e in events if e["choices"]][: cut + 1]
    merged = texts(before)
    for index, text in texts(after).items():
        merged[index] = merged.get(index, "") + text
    assert merged == texts(events)
    wrong = await real.get(f"/v1/streams/{request_id}", headers={"Last-Event-ID": "3"})
    assert_error(wrong, 400, "Last-Event-ID")


@pytest.mark.asyncio
async def test_a_client_gone_aborts_every_prompt_of_its_batch(
    engine, model_dir, redis_url, monkeypatch
):
    hold_steps(engine, monkeypatch, None)  # no token: only the aborts end the requests
    body = {"model": TINY, "prompt": BATCH, "max_tokens": 8, **GREEDY}
    async with serving(engine, redis_url), api(redis_url, TINY, model_dir) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json=body, timeout=1.0)
        await until(lambda: _two(aborts(redis_url)), "both prompts aborted")
        async with api(redis_url, TINY, model_dir, resume_grace_s=0) as streaming:
            async with streaming.stream("POST", "/v1/completions", json={**body, "stream": True}):
                pass  # gone before its first event
            await until(lambda: _two(aborts(redis_url), 4), "both streamed prompts aborted")
    # (serving checked that the KV pool is free again)
    first, second = (await aborts(redis_url))[:2], (await aborts(redis_url))[2:]
    for pair in (first, second):
        stem = pair[0].rsplit("-", 1)[0]
        assert sorted(pair) == [f"{stem}-0", f"{stem}-1"]


async def _two(ids, count: int = 2) -> bool:
    return len(await ids) >= count


@pytest.mark.asyncio
async def test_a_batch_larger_than_the_queue_is_400(redis_url, fake):
    async with api(redis_url, MODEL, SMOLLM2, max_pending=2) as client:
        response = await client.post("/v1/completions", json={**COMPLETION, "prompt": ["a"] * 3})
        assert_error(response, 400, "prompt")
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200


# ---- item 5: echo ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_echo_with_max_tokens_0_gives_the_prompt_logprobs(real, offline):
    """lm-eval-harness's log-likelihood request. Before: "'echo' is not supported"."""
    tokenizer = offline.get_tokenizer()
    (expected,) = offline.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2))
    body = {"model": TINY, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2}
    answer = (await real.post("/v1/completions", json={**body, "temperature": 0})).json()
    (choice,) = answer["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    prompt_ids = expected.prompt_token_ids
    assert answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["prompt_tokens"] == len(prompt_ids)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in prompt_ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(1, len(prompt_ids)):
        want = expected.prompt_logprobs[position]
        token = prompt_ids[position]
        assert logprobs["token_logprobs"][position] == pytest.approx(want[token].logprob, abs=1e-4)
        assert logprobs["top_logprobs"][position] == pytest.approx(
            {tokenizer.decode([t]): lp.logprob for t, lp in want.items()}, abs=1e-4
        )
    offsets = [sum(map(len, logprobs["tokens"][:i])) for i in range(len(prompt_ids))]
    assert logprobs["text_offset"] == offsets
    # Token-id prompts echo their decoded text.
    by_ids = (await real.post("/v1/completions", json={**body, "prompt": prompt_ids})).json()
    assert by_ids["choices"][0]["text"] == tokenizer.decode(prompt_ids)
    assert by_ids["choices"][0]["logprobs"]["token_logprobs"] == logprobs["token_logprobs"]


@pytest.mark.asyncio
async def test_echo_with_generation_puts_the_prompt_first(real, offline):
    (expected,) = offline.generate(
        PROMPT, SamplingParams(max_tokens=3, logprobs=1, prompt_logprobs=1, **GREEDY)
    )
    body = {"model": TINY, "prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1}
    choice = (await real.post("/v1/completions", json={**body, **GREEDY})).json()["choices"][0]
    generated = expected.outputs[0]
    assert choice["text"] == PROMPT + generated.text
    logprobs = choice["logprobs"]
    num_prompt = len(expected.prompt_token_ids)
    assert len(logprobs["tokens"]) == num_prompt + 3
    assert logprobs["token_logprobs"][num_prompt:] == pytest.approx(
        [d[t].logprob for t, d in zip(generated.token_ids, generated.logprobs, strict=True)],
        abs=1e-4,
    )
    assert logprobs["text_offset"][num_prompt] == len(PROMPT)  # offsets into the text
    # Streamed (no logprobs: those of a prompt are never streamed), the prompt comes first.
    stream = {**body, "logprobs": None, "stream": True, "n": 2, **GREEDY}
    events = parse_sse((await real.post("/v1/completions", json=stream)).text)[:-1]
    assert [e["data"]["choices"][0] for e in events[:2]] == [
        {"index": i, "text": PROMPT, "logprobs": None, "finish_reason": None, "stop_reason": None}
        for i in range(2)
    ]
    for index in range(2):
        pieces = [c["text"] for e in events for c in e["data"]["choices"] if c["index"] == index]
        assert "".join(pieces) == PROMPT + generated.text
    assert_error(await real.post("/v1/completions", json={**stream, "logprobs": 1}), 400, "echo")
    only = {**stream, "max_tokens": 0}
    events = parse_sse((await real.post("/v1/completions", json=only)).text)[:-1]
    assert "".join(c["text"] for e in events for c in e["data"]["choices"]) == PROMPT * 2
    assert [c["finish_reason"] for e in events for c in e["data"]["choices"]][-2:] == ["length"] * 2


@pytest.mark.asyncio
async def test_max_tokens_0_needs_echo(http):
    assert_error(await http.post("/v1/completions", json={**COMPLETION, "max_tokens": 0}), 400)


# ---- item 5: chat template options -------------------------------------------------------------


CONVERSATION = [*CHAT, {"role": "assistant", "content": "Hello! How"}]


@pytest.mark.asyncio
async def test_add_generation_prompt_and_continue_final_message_shape_the_prompt(
    http, fake, smollm2
):
    """Before: both were ignored (the same prompt_tokens either way)."""

    def rendered(messages, **kwargs) -> list[int]:
        return apply_chat_template(smollm2, messages, **kwargs)[1]

    chat = {"model": MODEL, "max_tokens": 2}
    for extra, messages, expected in [
        ({}, CHAT, rendered(CHAT)),
        ({"add_generation_prompt": False}, CHAT, rendered(CHAT, add_generation_prompt=False)),
        (
            {"continue_final_message": True},
            CONVERSATION,
            rendered(CONVERSATION, add_generation_prompt=False, continue_final_message=True),
        ),
    ]:
        body = {**chat, "messages": messages, **extra}
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        assert fake.requests[-1].prompt_token_ids == expected, extra
        tokenized = await http.post("/tokenize", json={"messages": messages, **extra})
        assert tokenized.json()["tokens"] == expected
    assert len({tuple(r.prompt_token_ids) for r in fake.requests}) == 3
    text = smollm2.decode(fake.requests[-1].prompt_token_ids)
    assert text.endswith("<|im_start|>assistant\nHello! How")  # open: no <|im_end|>
    both = {**chat, "messages": CONVERSATION, "continue_final_message": True}
    both["add_generation_prompt"] = True
    assert_error(await http.post("/v1/chat/completions", json=both), 400, "continue_final_message")


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer with a template reading one variable of its own."""
    tokenizer = load_tokenizer(SMOLLM2)
    tokenizer.chat_template += "{% if enable_thinking %}<think>{% endif %}"
    path = tmp_path_factory.mktemp("thinking")
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.asyncio
async def test_chat_template_kwargs_reach_the_template(redis_url, fake, thinking_dir):
    tokenizer = load_tokenizer(thinking_dir)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    async with api(redis_url, MODEL, thinking_dir) as client:
        for kwargs in ({}, {"enable_thinking": True}):
            answer = await client.post(
                "/v1/chat/completions", json={**body, "chat_template_kwargs": kwargs}
            )
            assert answer.status_code == 200, answer.text
            expected = apply_chat_template(tokenizer, CHAT, **kwargs)[1]
            assert fake.requests[-1].prompt_token_ids == expected
            tokenized = await client.post(
                "/tokenize", json={"messages": CHAT, "chat_template_kwargs": kwargs}
            )
            assert tokenized.json()["tokens"] == expected
        assert tokenizer.decode(fake.requests[-1].prompt_token_ids).endswith("<think>")
        # A key the template does not read, or one that is rendering's own, changes nothing.
        for key in ("enable_reasoning", "tokenize", "messages", "add_generation_prompt"):
            refused = await client.post(
                "/v1/chat/completions", json={**body, "chat_template_kwargs": {key: True}}
            )
            assert_error(refused, 400, f"chat_template_kwargs.{key}")
    async with api(redis_url, MODEL, thinking_dir, unknown_fields="warn") as lenient:
        ignored = {**body, "chat_template_kwargs": {"tokenize": True, "enable_thinking": True}}
        assert (await lenient.post("/v1/chat/completions", json=ignored)).status_code == 200
        assert fake.requests[-1].prompt_token_ids == expected


# ---- item 5: logprobs bytes --------------------------------------------------------------------


def test_token_bytes_of_a_byte_level_vocabulary(smollm2):
    """Before: a token holding part of a character had the bytes of U+FFFD."""
    token_bytes = TokenBytes(smollm2)
    text = "é😀 hi<|im_end|>"
    ids = smollm2(text).input_ids
    assert b"".join(token_bytes(t) for t in ids) == text.encode()
    fragments = [t for t in ids if smollm2.decode([t]) == "\ufffd"]
    assert fragments and all(token_bytes(t) != "\ufffd".encode() for t in fragments)
    assert len({token_bytes(t) for t in range(256, 49152)}) == 49152 - 256  # none collide


def test_token_bytes_of_a_sentencepiece_vocabulary():
    """Llama 2 / Mistral style: U+2581 for a space, `<0xNN>` byte-fallback pieces."""
    vocab = {"<unk>": 0, "<0xE2>": 1, "<0x82>": 2, "<0xAC>": 3, "▁hello": 4, "é": 5}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"eos_token": "</s>"})
    token_bytes = TokenBytes(tokenizer)
    assert [token_bytes(t) for t in range(6)] == [
        b"<unk>",
        b"\xe2",
        b"\x82",
        b"\xac",
        b" hello",
        "é".encode(),
    ]
    assert token_bytes(tokenizer.eos_token_id) == b"</s>"
    assert b"".join(token_bytes(t) for t in (1, 2, 3)).decode() == "€"


@pytest.mark.asyncio
async def test_chat_logprobs_bytes_are_the_tokens_bytes(real, smollm2):
    fragment = smollm2("😀").input_ids[0]  # b"\xf0\x9f": the start of a 4-byte character
    body = {"model": TINY, "messages": CHAT, "max_tokens": 2, "logprobs": True, **GREEDY}
    body["logit_bias"] = {str(fragment): 100}
    for stream in (False, True):
        response = await real.post("/v1/chat/completions", json={**body, "stream": stream})
        if stream:
            chunks = [e["data"]["choices"][0] for e in parse_sse(response.text)[:-1]]
            content = [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
        else:
            content = response.json()["choices"][0]["logprobs"]["content"]
        assert [e["bytes"] for e in content] == [[0xF0, 0x9F]] * 2
        assert [e["token"] for e in content] == [smollm2.decode([fragment])] * 2


@pytest.mark.asyncio
async def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(real):
    """OpenAI's `usage.prompt_tokens_details.cached_tokens`: 0 the first time a prompt is
    seen, its full blocks the second time, streamed or not."""
    prompt = list(range(300, 340))  # 40 tokens: two full blocks of 16
    body = {"model": TINY, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = (await real.post("/v1/completions", json=body)).json()["usage"]
    second = (await real.post("/v1/completions", json=body)).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens_details"] == {"cached_tokens": 32}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events((await real.post("/v1/completions", json=streamed)).text)[1]
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
