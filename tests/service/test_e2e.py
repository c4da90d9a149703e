"""The whole service as a user runs it: `kvrail serve` / `kvrail worker` processes, a real Redis,
the official OpenAI client, raw Redis producers, and faults (SIGKILL, disconnects)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from queueing.client import KvrailClient
from queueing.redis_server import EmbeddedRedis, die_with_parent, free_port
from queueing.schema import GenerateRequest, keys
from tests.engine.tiny_models import make_tiny_model, smollm2_dir

KVRAIL = str(Path(sys.executable).parent / "kvrail")
MODEL = "SmolLM2-135M-Instruct"
SERVE_READY_S = 60  # README: `make run` serves within this (warm model cache)
RESUME_GRACE_S = 0.5  # a client that left is aborted this long after, unless it came back
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [KVRAIL, *args],
        env={**os.environ, "KVRAIL_LOG_JSON": "1", **env},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent,  # nothing outlives a killed test run
    )


def wait_healthy(base_url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> float:
    start_time = time.monotonic()
    while time.monotonic() - start_time < timeout_s:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                return time.monotonic() - start_time
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not healthy in {timeout_s} s: {log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout_s: float = 30) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    return proc.wait(timeout_s)


@pytest.fixture(scope="module")
def redis_e2e():
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="module")
def served(redis_e2e, tmp_path_factory):
    """`kvrail serve` on the default model against the module's Redis."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # fp32: tokens are compared with an offline reference that batches differently.
    env = {"REDIS_URL": redis_e2e, "KVRAIL_RESUME_GRACE_S": str(RESUME_GRACE_S)}
    proc = start(["serve", "--port", str(port), "--dtype", "float32"], env, log)
    base_url = f"http://127.0.0.1:{port}"
    wait_healthy(base_url, proc, log, SERVE_READY_S)
    yield base_url, redis_e2e
    assert stop(proc) == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def offline():
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_dir())


def metric(text: str, name: str, **labels: str) -> float:
    """Sample `name` of the served model's engine metrics, on a /metrics page (0 if absent)."""
    labels = {"model_name": MODEL, **labels}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


@pytest_asyncio.fixture
async def client(served):
    async with KvrailClient(served[1]) as c:
        yield c


@pytest.mark.asyncio
async def test_openai_client_against_kvrail_serve(served, tokenizer):
    base_url, _ = served
    oai = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused")
    models = await oai.models.list()
    assert [m.id for m in models.data] == [MODEL]

    chat = await oai.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=24
    )
    assert "Paris" in chat.choices[0].message.content
    templated = tokenizer.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    num_prompt = len(tokenizer.encode(templated, add_special_tokens=False))
    assert chat.usage.prompt_tokens == num_prompt

    stream = await oai.chat.completions.create(
        model=MODEL,
        messages=FRANCE,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == chat.choices[0].message.content
    assert usage.prompt_tokens == num_prompt

    completion = await oai.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8
    )
    assert "Paris" in completion.choices[0].text
    assert completion.usage.prompt_tokens == len(tokenizer.encode("The capital of France is"))
    await oai.close()


@pytest.mark.asyncio
async def test_http_redis_and_offline_paths_agree(served, client, offline, tokenizer):
    base_url, _ = served
    prompts = ["The capital of France is", "Water boils at", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = offline.generate(prompts, params)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        for prompt, ref in zip(prompts, reference, strict=True):
            body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 20}
            body["ignore_eos"] = True
            response = (await http.post("/v1/completions", json=body)).json()
            assert response["choices"][0]["text"] == ref.outputs[0].text
            assert response["usage"]["completion_tokens"] == len(ref.outputs[0].token_ids)

            request_id = uuid.uuid4().hex
            await client.submit(
                GenerateRequest(
                    request_id,
                    prompt_token_ids=tokenizer.encode(prompt),
                    sampling={"temperature": 0.0, "max_tokens": 20, "ignore_eos": True},
                )
            )
            token_ids = [t async for c in client.stream(request_id) for t in c.token_ids]
            assert token_ids == ref.outputs[0].token_ids


@pytest.mark.asyncio
async def test_disconnect_aborts_and_frees_kv(served):
    base_url, _ = served
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400}
    body.update(stream=True, ignore_eos=True)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        text = (await http.get("/metrics")).text
        before = metric(text, "kvrail:request_success_total", finished_reason="abort")
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("id: 3"):
                    break  # leave mid-stream
        left = time.monotonic()
        while True:
            text = (await http.get("/metrics")).text
            if metric(text, "kvrail:kv_cache_usage_perc") == 0:
                break
            bound_s = RESUME_GRACE_S + 1.0
            assert time.monotonic() - left < bound_s, f"KV blocks in use {bound_s} s after"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        text = (await http.get("/metrics")).text
        assert metric(text, "kvrail:request_success_total", finished_reason="abort") == before + 1


@pytest.mark.asyncio
async def test_last_event_id_resume_returns_the_rest(served):
    base_url, _ = served
    body = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0, "max_tokens": 12}
    body.update(stream=True, ignore_eos=True)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        response = await http.post("/v1/completions", json=body)
        events = parse_sse(response.text)
        request_id = events[0][1].split('"id":"')[1].split('"')[0]
        seqs = [int(e[0]) for e in events if e[0] is not None]
        assert seqs == list(range(len(seqs))) and len(seqs) >= 12
        resumed = await http.get(f"/v1/streams/{request_id}", headers={"Last-Event-ID": "4"})
        rest = parse_sse(resumed.text)
        assert [e for e in rest if e[0] is not None] == [e for e in events if e[0] is not None][5:]
        assert rest[-1] == (None, "[DONE]")


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """(id, data) per event."""
    events = []
    for block in text.strip().split("\n\n"):
        event_id = data = None
        for line in block.splitlines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                data = line[6:]
        events.append((event_id, data))
    return events


@pytest.mark.asyncio
async def test_same_request_id_twice_is_generated_once(served, client):
    request_id = uuid.uuid4().hex
    request = GenerateRequest(
        request_id, prompt="Count to ten:", sampling={"max_tokens": 40, "ignore_eos": True}
    )
    await client.submit(request)
    await client.submit(request)
    first, second = await asyncio.gather(collect(client, request_id), collect(client, request_id))
    assert first == second
    assert [c.seq for c in first] == list(range(len(first)))
    assert sum(len(c.token_ids) for c in first) == 40
    entries = await client.redis.xrange(keys.response(request_id))
    assert len(entries) == len(first)  # one generation wrote the stream


async def collect(client: KvrailClient, request_id: str) -> list:
    return [c async for c in client.stream(request_id)]


def test_two_workers_one_killed_every_request_completes(tmp_path):
    """16 streaming requests over two workers; one is SIGKILLed mid-generation."""
    model = make_tiny_model(tmp_path / "tiny", "llama")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [f"Request number {i}: tell me about the number {i * 7}." for i in range(16)]
    reference = LLM(str(model), dtype="float32").generate(prompts, params)

    redis = EmbeddedRedis().start()  # private: no other test's entries in this group
    env = {"REDIS_URL": redis.url, "KVRAIL_CLAIM_IDLE_MS": "1500"}
    workers = [
        start(["worker", "--model", str(model), "--name", f"w{i}", "--max-num-seqs", "8",
               "--dtype", "float32"], env,
              tmp_path / f"w{i}.log")
        for i in range(2)
    ]  # fmt: skip
    try:
        results = asyncio.run(run_and_kill(redis.url, prompts, workers, tmp_path))
    finally:
        for proc in workers:
            stop(proc, signal.SIGKILL)
        redis.cleanup()
    for chunks, ref in zip(results, reference, strict=True):
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert [t for c in chunks for t in c.token_ids] == ref.outputs[0].token_ids
        assert "".join(c.text for c in chunks) == ref.outputs[0].text


MAX_TOKENS = 200  # long enough that w0 is caught mid-generation whatever the engine's speed


async def run_and_kill(url: str, prompts: list[str], workers, tmp_path) -> list[list]:
    async with KvrailClient(url) as client:
        deadline = time.monotonic() + 90
        while len(await client.workers()) < 2:
            assert time.monotonic() < deadline, (tmp_path / "w0.log").read_text()[-2000:]
            await asyncio.sleep(0.2)
        ids = []
        for prompt in prompts:
            ids.append(uuid.uuid4().hex)
            sampling = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
            await client.submit(GenerateRequest(ids[-1], prompt=prompt, sampling=sampling))
        readers = [asyncio.create_task(collect(client, i)) for i in ids]
        # Kill w0 while it holds requests (delivered, not yet acknowledged: acks come after a
        # request's last chunk) and chunks are out: some of its chunks are sent, others not.
        deadline = time.monotonic() + 60
        while True:
            pending = await client.redis.xpending(keys.requests, keys.group)
            holders = {c["name"].decode(): c["pending"] for c in pending["consumers"]}
            started = await client.redis.exists(*(keys.response(i) for i in ids))
            if holders.get("w0", 0) > 0 and started:
                break
            assert time.monotonic() < deadline, "w0 never held a request while chunks were out"
            await asyncio.sleep(0.01)
        os.killpg(workers[0].pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*readers), timeout=120)


def test_make_run_serves_within_the_readme_bound(tmp_path):
    """`kvrail serve` with no REDIS_URL: embedded Redis, healthy in time, clean Ctrl-C."""
    port = free_port()
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.Popen(
        [KVRAIL, "serve", "--port", str(port)],
        env={**env, "KVRAIL_LOG_JSON": "1"},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent,  # nothing outlives a killed test run
    )
    try:
        elapsed = wait_healthy(f"http://127.0.0.1:{port}", proc, log, SERVE_READY_S)
        body = {"model": MODEL, "messages": FRANCE, "temperature": 0, "max_tokens": 16}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert "Paris" in answer.json()["choices"][0]["message"]["content"]
    finally:
        code = stop(proc)
    assert code == 0, log.read_text()[-3000:]
    assert elapsed < SERVE_READY_S
    assert (
        "redis-server"
        not in subprocess.run(
            ["pgrep", "-s", str(proc.pid), "-a"], capture_output=True, text=True
        ).stdout
    )
