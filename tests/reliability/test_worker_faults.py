"""Faults 4, 6 and 7 on an in-process `Worker` (a real Redis, a tiny model): poison requests in
a busy batch, KV demand five times the pool, and deadlines under load. Fast: part of
`make test`.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import LLM, LLMEngine, SamplingParams
from queueing import streams
from queueing.schema import GenerateRequest, TokenChunk, keys
from tests.engine.tiny_models import make_tiny_model
from tests.reliability.harness import GREEDY, prompts
from tests.service.test_worker import hold_steps, read_chunks, sample, serving, submit

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama"))


def tiny_engine(model_dir: str, **overrides) -> LLMEngine:
    """The worker's engine: fp32 (tokens are compared with a differently batched reference)."""
    kwargs = dict(dtype="float32", max_model_len=512, num_kv_blocks=128, block_size=16)
    return LLMEngine.from_kwargs(model=model_dir, **{**kwargs, **overrides})


def offline(model_dir: str, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy reference on a pool large enough that nothing is preempted."""
    llm = LLM(model=model_dir, dtype="float32", max_model_len=512, num_kv_blocks=512, block_size=16)
    outputs = llm.generate(texts, SamplingParams(max_tokens=max_tokens, **GREEDY))
    return [o.outputs[0].token_ids for o in outputs]


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def test_poison_entries_in_a_busy_batch_harm_only_themselves(model_dir, redis_url):
    """Token ids outside the vocabulary, in the prompt or in a forged response stream that the
    worker would resume from, and undecodable entries, arrive while 12 good requests run."""
    texts = prompts(12)
    expected = offline(model_dir, texts, MAX_TOKENS)
    engine = tiny_engine(model_dir, max_num_seqs=16)
    r = streams.connect(redis_url)
    sampling = {"max_tokens": MAX_TOKENS, **GREEDY}
    async with serving(engine, redis_url):
        for i, text in enumerate(texts):
            await submit(r, GenerateRequest(f"good{i}", prompt=text, sampling=sampling))
        poison = await _submit_poison(r, engine.engine_core.model_runner.vocab_size)
        good = [await read_chunks(r, f"good{i}") for i in range(len(texts))]
        bad = {rid: (await read_chunks(r, rid))[-1] for rid in poison}
        await submit(r, GenerateRequest("after", prompt=texts[0], sampling=sampling))
        after = await read_chunks(r, "after")
    assert [tokens(c) for c in good] == expected
    assert all(c.finish_reason == "error" and c.error for c in bad.values()), bad
    assert "vocab" in bad["oov-prompt"].error or "[0," in bad["oov-prompt"].error
    assert "resumed token ids" in bad["oov-resume"].error
    dead = {f[b"entry_id"].decode(): f[b"reason"].decode() for _, f in await r.xrange(keys.dead)}
    assert len(dead) == len(poison) + 1  # + the entry that is not msgpack at all
    assert tokens(after) == expected[0]
    await r.aclose()


async def _submit_poison(r, vocab_size: int) -> list[str]:
    """Poison entries, each answerable on its response stream; returns their request ids."""
    await r.xadd(keys.requests, {"data": b"\xc1 not msgpack"})
    await submit(r, GenerateRequest("oov-prompt", prompt_token_ids=[1, vocab_size]))
    # Anyone can write a response stream: a forged chunk makes the worker "resume" with a
    # token id the embedding table does not have (this failed the whole batch's step).
    forged = TokenChunk("oov-resume", 0, token_ids=[vocab_size + 5], text="?")
    await r.xadd(keys.response("oov-resume"), {"data": forged.encode()})
    await submit(r, GenerateRequest("oov-resume", prompt="hello"))
    mistyped = TokenChunk("str-resume", 0, token_ids=["x"], text="?")
    await r.xadd(keys.response("str-resume"), {"data": mistyped.encode()})
    await submit(r, GenerateRequest("str-resume", prompt="hello"))
    return ["oov-prompt", "oov-resume", "str-resume"]


async def test_kv_demand_five_times_the_pool_preempts_and_completes(model_dir, redis_url):
    """10 requests of ~8 blocks each on a 16-block pool: recompute after preemption gives the
    reference tokens, the preemptions show in the metrics, and the oldest is not starved."""
    texts = prompts(10)
    max_tokens = 110
    expected = offline(model_dir, texts, max_tokens)
    engine = tiny_engine(model_dir, max_model_len=256, num_kv_blocks=16, max_num_seqs=8)
    r = streams.connect(redis_url)
    started = time.monotonic()
    async with serving(engine, redis_url, claim_idle_ms=2000) as worker:
        before = sample("kvrail:num_preemptions_total", worker.model_name)
        for i, text in enumerate(texts):
            sampling = {"max_tokens": max_tokens, **GREEDY}
            await submit(r, GenerateRequest(f"kv{i}", prompt=text, sampling=sampling))
        done_at = await _finish_times(r, [f"kv{i}" for i in range(len(texts))])
        await asyncio.sleep(worker.tick_s * 2)  # the heartbeat tick moves counters to metrics
    after = sample("kvrail:num_preemptions_total", worker.model_name)
    assert [tokens(c) for c, _ in done_at] == expected
    assert after - before > 0
    finish_order = sorted(range(len(texts)), key=lambda i: done_at[i][1])
    assert finish_order.index(0) < len(texts) // 2, finish_order  # the oldest is served early
    assert max(t for _, t in done_at) - started < 60
    print(f"preemptions: {after - before:.0f}, finish order: {finish_order}")
    await r.aclose()


async def _finish_times(r, request_ids: list[str]) -> list[tuple[list[TokenChunk], float]]:
    async def one(rid: str) -> tuple[list[TokenChunk], float]:
        chunks = await read_chunks(r, rid, timeout=60)
        return chunks, time.monotonic()

    return await asyncio.gather(*(one(rid) for rid in request_ids))


async def test_deadlines_end_running_and_queued_requests_on_time(model_dir, redis_url, monkeypatch):
    """Two sequences at a time; six long requests with a 400 ms deadline (two run, four wait)
    and two without: the six end with "deadline exceeded" within one heartbeat tick of their
    deadline, no chunk of theirs is stored later, and the other two complete."""
    engine = tiny_engine(model_dir, max_num_seqs=2)
    hold_steps(engine, monkeypatch, [f"late{i}" for i in range(6)], free_steps=3)
    r = streams.connect(redis_url)
    async with serving(engine, redis_url, claim_idle_ms=1000) as worker:
        deadline_ms = int(time.time() * 1000) + 400
        long = {"max_tokens": 480, **GREEDY}
        for i in range(6):
            request = GenerateRequest(f"late{i}", prompt="Go on", sampling=long)
            request.deadline_ms = deadline_ms
            await submit(r, request)
        for i in range(2):
            sampling = {"max_tokens": 8, **GREEDY}
            await submit(r, GenerateRequest(f"free{i}", prompt="Go on", sampling=sampling))
        late = [await read_chunks(r, f"late{i}") for i in range(6)]
        free = [await read_chunks(r, f"free{i}") for i in range(2)]
        slack_ms = worker.tick_s * 1000 + 500
    for i, chunks in enumerate(late):
        assert chunks[-1].error == "deadline exceeded", chunks[-1]
        assert len(tokens(chunks)) < 480
        [(last_id, _)] = await r.xrevrange(keys.response(f"late{i}"), count=1)
        assert int(last_id.split(b"-")[0]) <= deadline_ms + slack_ms
    assert all(c[-1].usage["completion_tokens"] == 8 for c in free)
    await r.aclose()
