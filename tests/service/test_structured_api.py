"""Issue 14, items 2 and 3: structured outputs and tool calls through the OpenAI API.

Parsing is checked on the parsers themselves (what each body becomes on the wire), the tool
parser on its own (a stream, cut anywhere, says what the whole answer says), and the rest
end to end: the official `openai` client against the API and a real `Worker` on the tiny
random-weight model, always on a real Redis. A random model writes any text its grammar
allows, so what holds for it (every answer parses and validates) holds for any model.
"""

from __future__ import annotations

import itertools
import json
from typing import Literal

import openai
import pytest
import pytest_asyncio
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from engine import LLMEngine, apply_chat_template, load_tokenizer
from engine.chat_template import HERMES_TOOLS_PROMPT
from queueing.schema import TokenChunk
from service.openai_protocol import (
    ApiError,
    ParseContext,
    RequestBody,
    StreamEvents,
    StreamShape,
    TokenStrings,
    parse_chat,
    parse_completion,
)
from service.tool_calls import ToolCallParser, ToolChoice, call_id, whole_answer
from tests.service.conftest import ENGINE_KWARGS
from tests.service.test_api import MODEL, FakeWorker, assert_error
from tests.service.test_openai_compat import SMOLLM2, TINY, api, sse_events
from tests.service.test_worker import serving

pytestmark = pytest.mark.timeout(180)


class City(BaseModel):
    """Bounded in every field, so a random model completes it within max_tokens."""

    name: str = Field(max_length=8)
    population: int = Field(ge=0, le=999)
    capital: bool
    climate: Literal["dry", "wet"]


class Weather(BaseModel):
    city: str = Field(max_length=6)
    unit: Literal["C", "F"]


class Alarm(BaseModel):
    hour: int = Field(ge=0, le=23)
    days: list[Literal["mon", "tue"]] = Field(min_length=1, max_length=2)


def compact(model: type[BaseModel]) -> dict:
    """A model's JSON schema without titles: the tools' prompt fits the tiny model's context."""
    schema = model.model_json_schema()
    schema.pop("title")
    for field in schema["properties"].values():
        field.pop("title")
    return schema


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": compact(Weather),
        },
    },
    {"type": "function", "function": {"name": "set_alarm", "parameters": compact(Alarm)}},
]
SCHEMAS = {"get_weather": Weather, "set_alarm": Alarm}
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(SMOLLM2)


@pytest.fixture(scope="module")
def context(smollm2) -> ParseContext:
    return ParseContext(MODEL, len(smollm2), frozenset(), "reject")


def chat(context: ParseContext, **fields):
    return parse_chat(RequestBody({"model": MODEL, "messages": CHAT, **fields}), context)


def completion(context: ParseContext, **fields):
    return parse_completion(RequestBody({"model": MODEL, "prompt": "x", **fields}), context)


def refused(parse, context: ParseContext, **fields) -> ApiError:
    with pytest.raises(ApiError) as error:
        parse(context, **fields)
    assert error.value.status == 400
    return error.value


# ---- item 2: the names of a constraint ---------------------------------------------------------


SCHEMA = City.model_json_schema()


@pytest.mark.parametrize("parse", [chat, completion])
@pytest.mark.parametrize(
    ("fields", "wire"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
                }
            },
            {"json": SCHEMA},
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
            {"json_object": True},
        ),
        ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            {"json": SCHEMA, "disable_any_whitespace": True},
        ),
        ({"guided_json": SCHEMA}, {"json": SCHEMA}),
        ({"guided_json": json.dumps(SCHEMA)}, {"json": json.dumps(SCHEMA)}),
        ({"guided_regex": "[0-9]{3}"}, {"regex": "[0-9]{3}"}),
        ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ({"guided_grammar": 'root ::= "a" | "b"'}, {"grammar": 'root ::= "a" | "b"'}),
    ],
)
def test_every_name_of_a_constraint_reaches_the_engine_as_structured_outputs(
    context, parse, fields, wire
):
    assert parse(context, **fields).sampling.get("structured_outputs") == wire


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
            "'response_format' is invalid",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "name' is required"),
        ({"response_format": {"type": "xml"}}, "response_format", "must be one of"),
        ({"response_format": "json"}, "response_format", "must be an object"),
        (
            {"response_format": {"type": "json_object", "schema": {}}},
            "response_format.schema",
            "Unknown parameter",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "scheme": {}},
                }
            },
            "response_format.json_schema.scheme",
            "Unknown parameter",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex", "'guided_regex' is invalid"),
        ({"guided_grammar": "root ::= "}, "guided_grammar", "'guided_grammar' is invalid"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", "unknown field"),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "guided_regex",
            "cannot be combined with 'response_format'",
        ),
    ],
)
def test_a_bad_constraint_is_a_400_naming_its_field(context, fields, param, says):
    for parse in (chat, completion):
        error = refused(parse, context, **fields)
        assert error.param == param and says in error.message, error.message


# ---- item 3: tools in the request --------------------------------------------------------------


def test_required_and_named_tool_choices_constrain_the_text_to_valid_calls(context):
    named = chat(
        context, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "set_alarm"}}
    )
    assert named.tool_choice == ToolChoice("named", "set_alarm")
    assert named.sampling["structured_outputs"] == {"json": compact(Alarm)}
    required = chat(context, tools=TOOLS, tool_choice="required")
    schema = required.sampling["structured_outputs"]["json"]
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [
        {"enum": ["get_weather"]},
        {"enum": ["set_alarm"]},
    ]
    one = chat(context, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert one.sampling["structured_outputs"]["json"]["maxItems"] == 1
    # auto: the model chooses; none: nothing is called and the prompt shows no tools
    auto = chat(context, tools=TOOLS)
    assert auto.tool_choice == ToolChoice("auto") and "structured_outputs" not in auto.sampling
    assert auto.chat_template.tools == TOOLS
    none = chat(context, tools=TOOLS, tool_choice="none")
    assert none.tool_choice is None and none.chat_template.tools is None


class Trip(BaseModel):
    stops: list[Weather] = Field(min_length=1, max_length=2)  # a `$ref` into `$defs`


def test_required_calls_keep_the_refs_of_nested_parameters(context):
    """Each tool's `$defs` move to the root of the array schema, where its `$ref`s point
    (xgrammar, which the parse runs, refuses a `$ref` it cannot resolve)."""
    trip = {"type": "function", "function": {"name": "plan_trip"}}
    trip["function"]["parameters"] = Trip.model_json_schema()
    schema = chat(context, tools=[*TOOLS, trip], tool_choice="required").sampling
    assert schema["structured_outputs"]["json"]["$defs"] == Trip.model_json_schema()["$defs"]
    other = {"type": "function", "function": {"name": "other"}}
    other["function"]["parameters"] = {**Trip.model_json_schema(), "$defs": {"Weather": {}}}
    error = refused(chat, context, tools=[trip, other], tool_choice="required")
    assert error.param == "tools" and "'$defs/Weather' differently" in error.message


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "must be 'none', 'auto'"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not one of 'tools'",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools", 'must be {"type": "function"'),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "1-64 of"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "distinct function names"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
            "tools",
            "not a valid JSON schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]},
            "tools[0].function.params",
            "Unknown parameter",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot be combined with 'tool_choice'",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "use 'tools'"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be a boolean"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(context, fields, param, says):
    error = refused(chat, context, **fields)
    assert error.param == param and says in error.message, error.message


def test_messages_take_tool_calls_tool_answers_and_the_developer_role(context):
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}
    messages = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}],
        },
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    parsed = parse_chat(RequestBody({"model": MODEL, "messages": messages}), context)
    assert parsed.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather\nin Paris?"},  # parts joined by newlines
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": {"city": "Paris", "unit": "C"},
                    },
                }
            ],
        },
        {"role": "tool", "content": "21 C", "tool_call_id": "call_1"},
    ]
    for bad in (
        {"role": "tool", "content": "21 C"},
        {"role": "robot", "content": "x"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
    ):
        with pytest.raises(ApiError) as error:
            parse_chat(RequestBody({"model": MODEL, "messages": [bad]}), context)
        assert error.value.param == "messages"


def test_a_template_without_tools_gets_them_in_hermes_form(smollm2, context):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "-3 C", "tool_call_id": "c"},
    ]
    text, _ = apply_chat_template(smollm2, messages, tools=TOOLS)
    tools = "\n".join(json.dumps(t) for t in TOOLS)
    assert text.startswith("<|im_start|>system\n" + HERMES_TOOLS_PROMPT.format(tools=tools))
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call_text}<|im_end|>" in text
    assert "<|im_start|>tool\n<tool_response>\n-3 C\n</tool_response><|im_end|>" in text
    # A system message keeps its text, the tools after it.
    system = [{"role": "system", "content": "Be brief."}, *messages]
    assert apply_chat_template(smollm2, system, tools=TOOLS)[0].startswith(
        "<|im_start|>system\nBe brief.\n\n# Tools\n"
    )


def test_a_template_that_reads_tools_renders_them_itself(smollm2, tmp_path):
    smollm2 = load_tokenizer(SMOLLM2)
    smollm2.chat_template = (
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}({{ c.function.arguments.city }}){% endfor %}|"
        "{% endfor %}"
    )
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    text, _ = apply_chat_template(smollm2, messages, add_generation_prompt=False, tools=TOOLS)
    assert text == "[get_weather][set_alarm]user:Hi|assistant:(Oslo)|"


# ---- item 3: the tool parser -------------------------------------------------------------------


HERMES = (
    "Let me look that up. \n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
    '<tool_call>{"name": "set_alarm", "parameters": {"hour": 7, "days": ["mon"]}}</tool_call>\n'
)


def streamed(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list]:
    content, deltas = "", []
    for piece in pieces:
        text, more = parser.feed(piece)
        content, deltas = content + text, deltas + more
    text, more = parser.finish()
    return content + text, deltas + more


def test_hermes_calls_are_read_and_the_text_around_them_is_content():
    content, calls = whole_answer(ToolCallParser(ToolChoice("auto"), "req", 0), HERMES)
    assert content == "Let me look that up."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}),
        ("set_alarm", {"hour": 7, "days": ["mon"]}),
    ]
    assert [c.id for c in calls] == [call_id("req", 0, 0), call_id("req", 0, 1)]
    assert call_id("req", 0, 0) != call_id("req", 1, 0)
    for text, content in [
        ("no calls at all ", "no calls at all "),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>"),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>'),
        ("a < b <tool", "a < b <tool"),  # a marker that never came
    ]:
        assert whole_answer(ToolCallParser(ToolChoice("auto"), "r", 0), text) == (content, [])
    # Llama 3.1's convention: an answer that is only `{"name", "parameters"}` objects.
    llama = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}; '
    llama += '{"name": "set_alarm", "parameters": {"hour": 6, "days": ["tue"]}}'
    content, calls = whole_answer(ToolCallParser(ToolChoice("auto"), "r", 0), "\n" + llama)
    assert content is None and [c.name for c in calls] == ["get_weather", "set_alarm"]
    for text in ('{"name": "Oslo", "population": 709000}', '{"name": "f", "parameters": {}} ok'):
        assert whole_answer(ToolCallParser(ToolChoice("auto"), "r", 0), text) == (text, [])
    # A call left open at the end (EOS before </tool_call>) is still a call.
    _, (call,) = whole_answer(
        ToolCallParser(ToolChoice("auto"), "r", 0), '<tool_call>{"name": "f"}'
    )
    assert (call.name, call.arguments) == ("f", "{}")


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_stream_cut_anywhere_says_what_the_whole_answer_says(data):
    text = data.draw(
        st.sampled_from(
            [
                HERMES,
                "plain text, no calls.  ",
                HERMES + "Done. ",
                "<tool_call>{bad}</tool_call> x",
                ' {"name": "f", "parameters": {"x": [1, 2]}};{"name": "g", "arguments": {}}',
                '{"name": "Oslo", "population": 709000} ',
            ]
        )
    )
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    whole_content, calls = whole_answer(ToolCallParser(ToolChoice("auto"), "r", 0), text)
    content, deltas = streamed(ToolCallParser(ToolChoice("auto"), "r", 0), pieces)
    assert content == (whole_content or "")
    assert [(d.index, d.id, d.name, d.arguments) for d in deltas] == [
        (i, c.id, c.name, c.arguments) for i, c in enumerate(calls)
    ]


def test_named_and_required_answers_are_their_calls():
    named = ToolCallParser(ToolChoice("named", "get_weather"), "r", 0)
    content, deltas = streamed(named, ['{"city"', ': "Oslo",', ' "unit": "C"}'])
    assert content == "" and [d.id is not None for d in deltas] == [True, False, False]
    assert "".join(d.arguments for d in deltas) == '{"city": "Oslo", "unit": "C"}'
    text = '[{"name": "set_alarm", "parameters": {"hour": 7, "days": ["tue"]}}]'
    content, (call,) = whole_answer(ToolCallParser(ToolChoice("required"), "r", 0), text)
    assert content is None and (call.name, call.arguments) == (
        "set_alarm",
        '{"hour": 7, "days": ["tue"]}',
    )
    # Cut short by max_tokens before a call was complete, the text is the content.
    cut = whole_answer(ToolCallParser(ToolChoice("required"), "r", 0), text[:20])
    assert cut == (text[:20], [])
    # Each call is sent as soon as its object is complete; a cut array keeps those calls.
    two = '[{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}},\n {"name": "se'
    parser = ToolCallParser(ToolChoice("required"), "r", 0)
    sent = [parser.feed(piece)[1] for piece in (two[:40], two[40:70], two[70:])]
    assert [[d.name for d in deltas] for deltas in sent] == [[], ["get_weather"], []]
    assert parser.finish() == ("", [])


def test_a_resumed_stream_of_tool_calls_goes_on_where_the_client_was(smollm2):
    """`/v1/streams/{id}` replays every chunk through a new parser: the events after
    Last-Event-ID are the ones the unbroken stream sent, call ids included."""
    cuts = [0, 9, 23, 30, 61, 95, 120, 150, len(HERMES)]
    pieces = [HERMES[a:b] for a, b in itertools.pairwise(cuts)]
    chunks = [
        TokenChunk("chatcmpl-1", seq, 0, [1], piece, finish_reason=None)
        for seq, piece in enumerate(pieces)
    ]
    chunks[-1].finish_reason, chunks[-1].usage = "stop", {"completion_tokens": len(pieces)}
    shape = StreamShape("chat", "chatcmpl-1", MODEL, 0, False, 3, tool_choice=ToolChoice("auto"))

    def events(after: int) -> list[str]:
        stream = StreamEvents(
            StreamShape.from_json(shape.to_json()), TokenStrings(smollm2), [after]
        )
        return [e for chunk in chunks for e in stream.for_chunk(0, chunk)]

    unbroken = events(-1)
    deltas = [json.loads(e.split("data: ")[1])["choices"][0] for e in unbroken]
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "set_alarm"]
    assert "".join(d["delta"].get("content", "") for d in deltas) == "Let me look that up."
    assert deltas[-1]["finish_reason"] == "tool_calls"
    for after in range(len(chunks)):
        assert events(after) == [
            e for e in unbroken if e.startswith("id: ") and int(e[4 : e.index("\n")]) > after
        ]


# ---- end to end, through the official client ---------------------------------------------------


@pytest.fixture(scope="module")
def engine(model_dir):
    """The module's engine, with room for the tools' prompt (about 300 tokens) and a call."""
    return LLMEngine.from_kwargs(
        model=model_dir, **{**ENGINE_KWARGS, "max_model_len": 1024, "num_kv_blocks": 256}
    )


@pytest_asyncio.fixture
async def real(engine, model_dir, redis_url):
    """The API and a real worker on the tiny model: the official client's base URL."""
    async with serving(engine, redis_url), api(redis_url, TINY, model_dir) as http:
        yield http


def client_of(http) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{http.base_url}/v1", api_key="none", max_retries=0)


@pytest.mark.asyncio
async def test_the_official_clients_parse_returns_the_model_every_time(real):
    client = client_of(real)
    for seed in range(4):
        completion = await client.chat.completions.parse(
            model=TINY,
            messages=CHAT,
            response_format=City,
            temperature=0.7,
            seed=seed,
            n=2,
            max_completion_tokens=200,
        )
        assert len(completion.choices) == 2
        for choice in completion.choices:
            assert choice.finish_reason == "stop"
            assert isinstance(choice.message.parsed, City), choice.message.content


@pytest.mark.asyncio
@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_streamed_constraints_hold_for_every_choice(real, temperature):
    """A nested JSON schema, a regex, a choice and a small grammar, streamed with n = 2,
    greedy and sampled."""
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "trip", "schema": Trip.model_json_schema()},
    }

    def is_trip(text: str) -> bool:
        Trip.model_validate_json(text)
        return True

    for extra, check in [
        ({"response_format": schema}, is_trip),
        ({"guided_regex": "[0-9]{2}-[a-c]{3}"}, lambda t: len(t) == 6 and t[2] == "-"),
        ({"guided_choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        (
            {"guided_grammar": 'root ::= "(" [0-9] ("+" [0-9])* ")"'},
            lambda t: t[0] == "(" and t[-1] == ")",
        ),
    ]:
        body = {"model": TINY, "prompt": "Go", "max_tokens": 300, "n": 2, "seed": 1}
        body["temperature"] = temperature
        answer = await real.post("/v1/completions", json={**body, **extra, "stream": True})
        assert answer.status_code == 200, answer.text
        texts, finish = {0: "", 1: ""}, {}
        for event in sse_events(answer.text)[1]:
            for choice in event["choices"]:
                texts[choice["index"]] += choice["text"]
                finish[choice["index"]] = choice["finish_reason"] or finish.get(choice["index"])
        assert finish == {0: "stop", 1: "stop"}, (extra, texts)
        assert all(check(t) for t in texts.values()), (extra, texts)


@pytest.mark.asyncio
async def test_an_invalid_schema_is_a_400_and_the_server_goes_on(real):
    body = {"model": TINY, "messages": CHAT, "max_tokens": 8}
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    assert_error(
        await real.post("/v1/chat/completions", json={**body, "response_format": bad}),
        400,
        "response_format",
    )
    good = {"type": "json_object"}
    answer = await real.post(
        "/v1/chat/completions", json={**body, "max_tokens": 100, "response_format": good}
    )
    assert answer.status_code == 200, answer.text


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_required_and_named_tool_calls_always_validate(real, stream):
    client = client_of(real)
    named = {"type": "function", "function": {"name": "set_alarm"}}
    for seed, tool_choice in zip(range(6), ["required", named] * 3, strict=True):
        kwargs = dict(
            model=TINY,
            messages=CHAT,
            tools=TOOLS,
            tool_choice=tool_choice,
            temperature=0.9,
            seed=seed,
            max_tokens=400,
        )
        if stream:
            content, calls = await _streamed(client, kwargs)
            assert content == ""
        else:
            completion = await client.chat.completions.create(**kwargs)
            (choice,) = completion.choices
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            calls = [
                (c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls
            ]
        assert calls
        for call_id_, name, arguments in calls:
            assert call_id_.startswith("call_")
            assert name == "set_alarm" or tool_choice == "required"
            SCHEMAS[name].model_validate_json(arguments)


async def _streamed(client: openai.AsyncOpenAI, kwargs) -> tuple[str, list[tuple[str, str, str]]]:
    """A stream's content and tool calls, put together from its deltas as OpenAI's clients
    do; its finish reason is "tool_calls"."""
    content, calls, finish = "", {}, None
    async for chunk in await client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    calls[delta.index] = [delta.id, delta.function.name, ""]
                calls[delta.index][2] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    return content, [tuple(c) for _, c in sorted(calls.items())]


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_auto_reads_the_calls_a_model_writes(real, stream):
    """The tiny model's output forced, by a regex, into a Hermes call after some text."""
    arguments = '{"city": "Oslo", "unit": "F"}'
    call = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    forced = {"regex": "Checking[.]\n" + call.replace("{", "[{]").replace("}", "[}]")}
    client = client_of(real)
    kwargs = dict(
        model=TINY,
        messages=CHAT,
        tools=TOOLS,
        max_tokens=400,
        extra_body={"structured_outputs": forced},
    )
    if stream:
        content, calls = await _streamed(client, kwargs)
    else:
        (choice,) = (await client.chat.completions.create(**kwargs)).choices
        assert choice.finish_reason == "tool_calls"
        content = choice.message.content
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert content == "Checking."
    ((_, name, arguments),) = calls
    assert name == "get_weather" and json.loads(arguments) == {"city": "Oslo", "unit": "F"}


@pytest.mark.asyncio
async def test_a_tool_history_reaches_the_model_through_its_template(redis_url, smollm2):
    fake = await FakeWorker(redis_url).start()
    try:
        async with api(redis_url, MODEL, SMOLLM2) as http:
            call = {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
            messages = [
                *CHAT,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
            ]
            body = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 2}
            answer = await http.post("/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
            templated = [
                *messages[:1],
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
                    ],
                },
                {"role": "tool", "content": "-3 C", "tool_call_id": "c1"},
            ]
            assert (
                fake.requests[-1].prompt_token_ids
                == apply_chat_template(smollm2, templated, tools=TOOLS)[1]
            )
            # tool_choice none: the same history, no tools shown
            answer = await http.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
            assert answer.status_code == 200, answer.text
            assert fake.requests[-1].prompt_token_ids == apply_chat_template(smollm2, templated)[1]
            assert answer.json()["choices"][0]["message"]["tool_calls"] == []
    finally:
        await fake.stop()


def strict_json(text: str):
    """JSON as the spec has it: -Infinity and NaN, which Python's json takes, refused."""

    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_logprobs_of_tokens_a_grammar_masks_are_finite(real, stream):
    """With two tokens allowed, the other top ones have -inf logprobs, clamped to -9999.0
    (OpenAI's and vLLM's floor) so the answer stays JSON."""
    for path, extra in [
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 5}),
        ("/v1/completions", {"prompt": "Go", "logprobs": 5}),
    ]:
        body = {"model": TINY, "max_tokens": 4, "guided_choice": ["yes", "no"], **extra}
        answer = await real.post(path, json={**body, "stream": stream})
        assert answer.status_code == 200, answer.text
        if stream:
            events = [strict_json(b.split("data: ", 1)[1]) for b in answer.text.split("\n\n")[:-2]]
        else:
            events = [strict_json(answer.text)]
        floors = [
            lp
            for event in events
            for choice in event["choices"]
            for lp in _logprob_values(choice.get("logprobs"))
        ]
        assert floors and min(floors) == -9999.0, path


def _logprob_values(logprobs) -> list[float]:
    if not logprobs:
        return []
    if "content" in logprobs:  # chat
        return [t["logprob"] for e in logprobs["content"] for t in e["top_logprobs"]]
    return [lp for top in logprobs["top_logprobs"] for lp in top.values()]
