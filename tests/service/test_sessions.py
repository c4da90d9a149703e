"""Streaming-input sessions on the wire: a real `Worker` on the tiny model, turns sent with
`KvrailClient.session` (and over HTTP, `session_id` on chat completions, through two API
apps), their chunks one `seq` sequence on the session's response stream.

Each turn must generate what a fresh offline request over the whole history generates, with
the session's KV kept between turns (only the new tokens computed), and a session must
survive its worker's loss between turns and within one: the next worker rebuilds the history
from the response stream and recomputes it. Every test ends with the KV pool fully free.
"""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from engine import LLM, SamplingParams
from queueing import streams
from queueing.client import KvrailClient, SessionError
from queueing.schema import GenerateRequest, SchemaError, TokenChunk, keys, session_history
from tests.service.conftest import ENGINE_KWARGS
from tests.service.test_api import assert_error, parse_sse
from tests.service.test_resume import started, two_apis
from tests.service.test_worker import hold_steps, read_chunks, serving, submit

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

GREEDY = dict(temperature=0.0, ignore_eos=True)
CHUNKS = [list(range(1000, 1030)), list(range(2000, 2007)), list(range(3000, 3011))]
MAX_TOKENS = [10, 6, 40]


@pytest.fixture(scope="module")
def offline(model_dir):
    """Fresh requests over whole histories: what every turn must generate (in a test, on a
    thread: a blocked event loop once left the client's reader hung in its cancelled XREAD
    at teardown)."""
    llm = LLM(model=model_dir, enable_prefix_caching=False, **ENGINE_KWARGS)

    def generate(prompt_token_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
        params = SamplingParams(max_tokens=max_tokens, **GREEDY)
        [out] = llm.generate(prompt_token_ids, params)
        return out.outputs[0].token_ids, out.outputs[0].text

    return generate


@pytest.fixture(scope="module")
def transcript(offline):
    """Per turn, the reference tokens and text, each over the history before it."""
    history, turns = [], []
    for chunk, max_tokens in zip(CHUNKS, MAX_TOKENS, strict=True):
        token_ids, text = offline(history + chunk, max_tokens)
        turns.append((token_ids, text))
        history += chunk + token_ids
    return turns


@pytest_asyncio.fixture
async def client(redis_url):
    async with KvrailClient(redis_url, chunk_timeout_s=20.0) as c:
        yield c


async def send(client, turn: int, resumable: bool = True) -> list[TokenChunk]:
    sampling = dict(max_tokens=MAX_TOKENS[turn], **GREEDY)
    turns = client.session("s").send(
        prompt_token_ids=CHUNKS[turn], sampling=sampling, resumable=resumable
    )
    return [chunk async for chunk in turns]


def joined(chunks: list[TokenChunk]) -> tuple[list[int], str]:
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)


async def test_a_session_over_the_wire(engine, transcript, client, redis, redis_url):
    """Turns 2 and 3 compute only their new tokens and the last one sampled before; the
    session waits between turns and is done after the last, its KV freed."""
    state = keys.request_state("s")
    async with serving(engine, redis_url) as worker:
        turns, prefill = [], []
        for turn in range(3):
            before = worker.engine_thread.stats.num_prefill_tokens
            turns.append(await send(client, turn, resumable=turn < 2))
            prefill.append(worker.engine_thread.stats.num_prefill_tokens - before)
            expected = b"waiting" if turn < 2 else b"done"
            await until_state(redis, "s", expected)
            if turn < 2:
                assert worker.engine_thread.stats.num_blocks_in_use > 0  # the session's KV
    assert [joined(chunks) for chunks in turns] == transcript
    seqs = [c.seq for chunks in turns for c in chunks]
    assert seqs == list(range(len(seqs)))  # one sequence across the turns
    assert prefill[1:] == [len(CHUNKS[1]) + 1, len(CHUNKS[2]) + 1]
    history = len(CHUNKS[0]) + MAX_TOKENS[0]
    usage = [chunks[-1].usage for chunks in turns]
    assert [u["prompt_tokens"] for u in usage] == [30, history + 7, history + 13 + 11]
    assert [u["cached_tokens"] for u in usage] == [0, history - 1, history + 13 - 1]
    assert await redis.hget(state, "turn") == b"2"
    assert await redis.xlen(keys.requests) == 0


async def until_state(redis, request_id: str, state: bytes) -> None:
    """The publisher marks the state after the last chunk is stored: wait for it."""
    for _ in range(1000):
        if await redis.hget(keys.request_state(request_id), "state") == state:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"state of {request_id} never became {state!r}")


def check_transcript(turns: list[list[TokenChunk]], transcript) -> None:
    assert [joined(chunks) for chunks in turns] == transcript
    seqs = [c.seq for chunks in turns for c in chunks]
    assert seqs == list(range(len(seqs)))


async def test_a_session_survives_its_worker_lost_between_turns(
    engine, transcript, client, redis_url
):
    """The next worker holds no KV of the session: it rebuilds the history from the response
    stream and recomputes it."""
    async with serving(engine, redis_url, name="a"):
        turns = [await send(client, 0)]
    async with serving(engine, redis_url, name="b") as worker:
        before = worker.engine_thread.stats.num_prefill_tokens
        turns.append(await send(client, 1))
        assert worker.engine_thread.stats.num_prefill_tokens - before > len(CHUNKS[1]) + 1
        turns.append(await send(client, 2, resumable=False))
    check_transcript(turns, transcript)


async def test_a_session_survives_its_worker_lost_within_a_turn(
    engine, transcript, client, redis, redis_url, monkeypatch
):
    """The worker serving turn 3 stops after 3 of its tokens (its entry left pending); the
    next claims the entry and resumes the turn over the history from the stream."""
    async with serving(engine, redis_url, name="a", grace_s=0.0):
        turns = [await send(client, 0), await send(client, 1)]
        hold_steps(engine, monkeypatch, ["s"], free_steps=3)
        third = asyncio.create_task(send(client, 2, resumable=False))
        while len(await read_chunks(redis, "s", until_last=False)) < sum(map(len, turns)) + 3:
            await asyncio.sleep(0.01)
    monkeypatch.undo()
    stored = await streams.read_response(redis, keys.response("s"))
    assert not stored[-1].is_last and stored[-1].turn == 2
    async with serving(engine, redis_url, name="b", claim_idle_ms=500):
        turns.append(await third)
    check_transcript(turns, transcript)
    assert turns[-1][-1].usage["completion_tokens"] == MAX_TOKENS[2]


async def test_chat_turns_are_templated_after_the_tokens_so_far(engine, offline, client, redis_url):
    """A later turn's messages (the new ones) follow the history's tokens as the template
    writes a next exchange: the answer's end of turn (ChatML's `<|im_end|>\n`: the answer
    stopped on max_tokens, not on its end-of-turn token), then the new user message and the
    generation prompt. The history is not re-tokenized."""
    tokenizer = engine.tokenizer
    first = [{"role": "user", "content": "Tell me about foxes."}]
    sampling = dict(max_tokens=8, **GREEDY)
    async with serving(engine, redis_url):
        session = client.session("chat")
        answer = [c async for c in session.send(messages=first, sampling=sampling)]
        second = [{"role": "user", "content": "And dogs?"}]
        reply = [c async for c in session.send(messages=second, sampling=sampling)]
    opening = tokenizer.encode(
        tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    )
    continuation = tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\nAnd dogs?<|im_end|>\n<|im_start|>assistant\n"
    )
    context = opening + joined(answer)[0] + continuation
    assert reply[0].prompt_token_ids == continuation
    assert joined(reply) == await asyncio.to_thread(offline, context, 8)
    history = session_history(answer + reply)
    assert history.token_ids == context + joined(reply)[0]


async def test_bad_turns_are_refused_clearly(engine, client, redis, redis_url):
    """A turn that skips ahead: refused by the client before it is sent, and by the worker
    (an error chunk naming the turn, the session closed) when sent raw; a resumable request
    with n > 1: the engine's error."""
    sampling = dict(max_tokens=2, **GREEDY)
    async with serving(engine, redis_url):
        await send(client, 0)
        skip = GenerateRequest("s", prompt_token_ids=[5, 6], sampling=sampling, turn=2)
        with pytest.raises(SessionError, match=r"turn 2 is not the next turn.*last one .* is 0"):
            await client.submit_turn(skip)
        await submit(redis, skip)
        while len(chunks := await read_chunks(redis, "s")) == MAX_TOKENS[0]:
            await asyncio.sleep(0.01)
        error = chunks[-1]
        assert error.error == "turn 2 of session 's' is not its next turn (1)"
        await until_state(redis, "s", b"done")
        with pytest.raises(SessionError, match="closed"):
            await send(client, 1)
        wide = dict(n=2, max_tokens=2, temperature=1.0)
        turns = client.session("wide").send(prompt_token_ids=[5, 6], sampling=wide)
        [failed] = [c async for c in turns]
        assert "resumable takes n=1" in failed.error
    for bad in (dict(turn=-1), dict(turn=2**31), dict(resumable=True, reply_to="kvrail:resp:x")):
        with pytest.raises(SchemaError, match=r"turn|reply_to"):
            GenerateRequest("t", prompt="hi", **bad).validate()


def chatml_turn(content: str) -> str:
    """What ChatML writes after an answer cut by max_tokens, for the next user message."""
    return f"<|im_end|>\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


async def test_chat_sessions_over_http_on_any_api_each_turn_its_own_response(
    engine, offline, model_dir, redis_url
):
    """Turns alternate between two API apps, streamed and not; each is answered as a fresh
    request over the history would be, in its own SSE stream (ids continuing the seqs) or
    JSON object, and `/v1/streams/{id}` replays the last turn."""
    tokenizer = engine.tokenizer
    questions = ["Tell me about foxes.", "And dogs?", "And cats?"]
    async with serving(engine, redis_url) as worker, two_apis(redis_url, model_dir) as apis:
        await started(worker, redis_url)
        answers = []
        for turn, question in enumerate(questions):
            body = {
                "model": "llama",
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 6,
                "session_id": "chat-1",
                "stream": turn != 1,
                "stream_options": {"include_usage": True} if turn != 1 else None,
                **GREEDY,
            }
            response = await apis[turn % 2].post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            answers.append(parse_sse(response.text) if turn != 1 else response.json())
        replay = parse_sse((await apis[1].get("/v1/streams/chat-1")).text)
    first = [{"role": "user", "content": questions[0]}]
    context = tokenizer.encode(
        tokenizer.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    )
    texts, usages = [], []
    for turn, answer in enumerate(answers):
        if turn:
            context += tokenizer.encode(chatml_turn(questions[turn]))
        token_ids, text = await asyncio.to_thread(offline, context, 6)
        if turn == 1:
            texts.append(answer["choices"][0]["message"]["content"])
            usages.append(answer["usage"])
        else:
            deltas = [e["data"]["choices"] for e in answer[:-1] if e["data"]["choices"]]
            texts.append("".join(c[0]["delta"].get("content", "") for c in deltas))
            usages.append(answer[-2]["data"]["usage"])
            assert answer[-1]["data"] == "[DONE]"
        assert texts[-1] == text
        assert usages[-1]["prompt_tokens"] == len(context)
        context += token_ids
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages[1:]] == [
        usages[0]["prompt_tokens"] + 6 - 1,
        usages[1]["prompt_tokens"] + 6 - 1,
    ]
    ids = [[e["id"] for e in answer if e["id"] is not None] for answer in (answers[0], answers[2])]
    assert ids == [list(range(6)), list(range(12, 18))]  # turn 2 had seqs 6-11
    assert [e["id"] for e in replay if e["id"] is not None] == ids[1]


async def test_session_requests_the_session_cannot_take_are_4xx(
    engine, client, model_dir, redis_url, monkeypatch
):
    body = {"model": "llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    async with serving(engine, redis_url) as worker, two_apis(redis_url, model_dir) as (http, _):
        await started(worker, redis_url)
        chat = "/v1/chat/completions"
        bad_id = await http.post(chat, json={**body, "session_id": "a b"})
        assert "'session_id' must be" in assert_error(bad_id, 400, "session_id")["message"]
        wide = await http.post(chat, json={**body, "session_id": "x", "n": 2})
        assert "'session_id' takes n=1" in assert_error(wide, 400, "n")["message"]
        plain = await http.post(chat, json=body)
        not_one = await http.post(chat, json={**body, "session_id": plain.json()["id"]})
        assert "not a session" in assert_error(not_one, 409, "session_id")["message"]
        hold_steps(engine, monkeypatch, ["held"], free_steps=1)
        sampling = dict(max_tokens=4, **GREEDY)
        held = GenerateRequest("held", prompt="Hi", sampling=sampling, resumable=True)
        await client.submit_turn(held)
        await read_chunks(client.redis, "held", until_last=False)  # its first token
        busy = await http.post(chat, json={**body, "session_id": "held"})
        assert "still running" in assert_error(busy, 409, "session_id")["message"]
        await client.abort("held")
        await until_state(client.redis, "held", b"done")
        closed = await http.post(chat, json={**body, "session_id": "held"})
        assert "closed" in assert_error(closed, 409, "session_id")["message"]
