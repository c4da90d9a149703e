"""vLLM's `use_beam_search` over the service: `n` beams, best first, through the request stream
and the worker's engine thread, as `LLMEngine` answers them offline; streamed whole; refused,
naming the field, where a beam search cannot apply. Always a real Redis."""

from __future__ import annotations

import pytest

from engine import BeamSearchParams
from queueing.schema import GenerateRequest, SchemaError
from service.openai_protocol import ChatTemplate
from tests.service import test_openai_compat
from tests.service.test_api import MODEL, assert_error, parse_sse
from tests.service.test_openai_compat import CHAT, TINY
from tests.service.test_worker import PROMPT

pytestmark = pytest.mark.timeout(120)
# test_openai_compat's fixtures: the API with the fake worker or a real one, the offline engine
fake, http, offline, real = (
    test_openai_compat.fake,
    test_openai_compat.http,
    test_openai_compat.offline,
    test_openai_compat.real,
)

BEAMS = {"n": 3, "max_tokens": 8, "use_beam_search": True, "length_penalty": 0.5}


def offline_beams(offline, prompt, params: BeamSearchParams):
    """The completions `LLMEngine` gives the beam search, best first, and its prompt length."""
    engine = offline.llm_engine
    engine.add_request("offline", prompt, params)
    (output,) = [o for _ in iter(engine.has_unfinished_requests, False) for o in engine.step()]
    return output.outputs, len(output.prompt_token_ids)


@pytest.mark.asyncio
async def test_completions_and_chat_answer_with_the_beams(real, offline):
    params = BeamSearchParams(3, 8, length_penalty=0.5)
    chat_ids = ChatTemplate().apply(offline.get_tokenizer(), CHAT)
    for path, body, prompt in [
        ("/v1/completions", {"prompt": PROMPT}, PROMPT),
        ("/v1/chat/completions", {"messages": CHAT}, chat_ids),
    ]:
        response = await real.post(path, json={"model": TINY, **body, **BEAMS})
        assert response.status_code == 200, response.text
        answer = response.json()
        expected, num_prompt_tokens = offline_beams(offline, prompt, params)
        choices = answer["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        texts = [c["message"]["content"] if "message" in c else c["text"] for c in choices]
        assert texts == [c.text for c in expected]
        assert [c["finish_reason"] for c in choices] == [c.finish_reason for c in expected]
        usage = answer["usage"]
        assert usage["prompt_tokens"] == num_prompt_tokens
        assert usage["completion_tokens"] == sum(len(c.token_ids) for c in expected)


@pytest.mark.asyncio
async def test_a_streamed_beam_search_sends_each_choice_whole_at_its_end(real, offline):
    """The beams change until the search ends: each choice comes in one event then."""
    body = {"model": TINY, "messages": CHAT, **BEAMS, "stream": True}
    body["stream_options"] = {"include_usage": True}
    response = await real.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    events = [e["data"] for e in parse_sse(response.text)]
    assert events.pop() == "[DONE]"
    usage = events.pop()["usage"]
    content = [e["choices"][0] for e in events if e["choices"][0]["delta"].get("content")]
    assert [c["index"] for c in content] == [0, 1, 2]
    assert all(c["finish_reason"] in ("stop", "length") for c in content)
    expected, _ = offline_beams(
        offline,
        ChatTemplate().apply(offline.get_tokenizer(), CHAT),
        BeamSearchParams(3, 8, length_penalty=0.5),
    )
    assert [c["delta"]["content"] for c in content] == [c.text for c in expected]
    assert usage["completion_tokens"] == sum(len(c.token_ids) for c in expected)


@pytest.mark.asyncio
async def test_the_wire_carries_the_beam_search_params(http, fake):
    body = {"model": MODEL, "prompt": "Hello", **BEAMS, "temperature": 0, "top_p": 1.0}
    assert (await http.post("/v1/completions", json=body)).status_code == 200
    (request,) = fake.requests
    assert request.sampling == {}
    assert request.beam_search == {
        "beam_width": 3,
        "max_tokens": 8,
        "ignore_eos": False,
        "length_penalty": 0.5,
    }
    with pytest.raises(SchemaError, match="beam_search cannot be combined"):
        GenerateRequest(
            "r", prompt="x", sampling={"n": 2}, beam_search=request.beam_search
        ).validate()


CHAT_BEAMS = {"model": MODEL, "messages": CHAT, **BEAMS}
COMPLETION_BEAMS = {"model": MODEL, "prompt": "Hello", **BEAMS}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("path", "body", "extra", "param"),
    [
        ("/v1/completions", COMPLETION_BEAMS, {"temperature": 0.7}, "temperature"),
        ("/v1/completions", COMPLETION_BEAMS, {"temperature": 1.0}, "temperature"),
        ("/v1/chat/completions", CHAT_BEAMS, {"top_p": 0.9}, "top_p"),
        ("/v1/completions", COMPLETION_BEAMS, {"logprobs": 2}, "logprobs"),
        ("/v1/chat/completions", CHAT_BEAMS, {"logprobs": True}, "logprobs"),
        ("/v1/completions", COMPLETION_BEAMS, {"stop": "x"}, "stop"),
        ("/v1/completions", COMPLETION_BEAMS, {"seed": 3}, "seed"),
        ("/v1/completions", COMPLETION_BEAMS, {"prompt_logprobs": 1}, "prompt_logprobs"),
        (
            "/v1/chat/completions",
            CHAT_BEAMS,
            {"response_format": {"type": "json_object"}},
            "response_format",
        ),
        ("/v1/completions", COMPLETION_BEAMS, {"n": 11}, "n"),
        ("/v1/completions", COMPLETION_BEAMS, {"best_of": 4}, "best_of"),
        ("/v1/completions", COMPLETION_BEAMS, {"length_penalty": "long"}, "length_penalty"),
        ("/v1/completions", COMPLETION_BEAMS, {"length_penalty": 1e308}, "length_penalty"),
        ("/v1/completions", COMPLETION_BEAMS, {"use_beam_search": 1}, "use_beam_search"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": CHAT},
            {"length_penalty": 2.0},
            "length_penalty",
        ),
    ],
)
async def test_what_a_beam_search_cannot_apply_is_400_naming_it(
    http, fake, path, body, extra, param
):
    error = assert_error(await http.post(path, json={**body, **extra}), 400, param)
    assert param in error["message"]
    assert not fake.requests
