"""A worker whose engine speculates: accepted runs stream as multi-token chunks, the text is
the one plain decoding gives, and the draft counters reach Prometheus."""

from __future__ import annotations

import pytest

from engine import LLM, LLMEngine, SamplingParams
from queueing.schema import GenerateRequest
from tests.engine.tiny_models import make_chain_model
from tests.service.conftest import ENGINE_KWARGS
from tests.service.test_worker import GREEDY, joined, read_chunks, sample, serving, submit, until

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
PROMPT = "Hello hello world, one two three"


@pytest.fixture(scope="module")
def chain_model(tmp_path_factory):
    """Greedy text that repeats itself: drafts from the prompt lookup get accepted."""
    path = make_chain_model(tmp_path_factory.mktemp("chain"), "llama", layer_scale=0.01,
                            cycle_length=5)  # fmt: skip
    return str(path)


async def test_a_speculating_worker_streams_accepted_runs(chain_model, redis, redis_url):
    params = SamplingParams(max_tokens=40, **GREEDY)
    (plain,) = LLM(chain_model, **ENGINE_KWARGS).generate(PROMPT, params)
    engine = LLMEngine.from_kwargs(model=chain_model, speculative_config=NGRAM, **ENGINE_KWARGS)
    drafts = "kvrail:spec_decode_num_drafts_total"
    per_pos = "kvrail:spec_decode_num_accepted_tokens_per_pos_total"
    async with serving(engine, redis_url) as worker:
        model = worker.model_name
        drafts_before, first_before = sample(drafts, model), sample(per_pos, model, position="0")
        sampling = dict(max_tokens=40, **GREEDY)
        await submit(redis, GenerateRequest("s1", prompt=PROMPT, sampling=sampling))
        chunks = await read_chunks(redis, "s1")
        # The heartbeat publishes the engine's counters.
        await until(lambda: sample(drafts, model) > drafts_before)
    assert joined(chunks) == (plain.outputs[0].token_ids, plain.outputs[0].text)
    assert max(len(c.token_ids) for c in chunks) > 1
    assert len(chunks) < 40
    assert sample(per_pos, model, position="0") > first_before
    assert sample("kvrail:spec_decode_num_accepted_tokens_total", model) <= sample(
        "kvrail:spec_decode_num_draft_tokens_total", model
    )
