"""The hand-written OpenAPI 3.1 document of `service.api`, served at `GET /openapi.json`.

Request schemas state the limits the handlers enforce (so a fuzzer's valid inputs are
accepted), the sampling fields' types and ranges taken from `SamplingParams`, and every
operation lists the error statuses it can answer, each with the OpenAI error body.
"""

from __future__ import annotations

from typing import Any

from engine import (
    MAX_ABS_LENGTH_PENALTY,
    MAX_ABS_LOGIT_BIAS,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    STRUCTURED_OUTPUT_KINDS,
    sampling_fields,
)
from queueing.schema import MAX_ID_LEN, MAX_PRIORITY
from service.openai_protocol import ROLES

_REF = "#/components/schemas/"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF + name}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_STOP = {
    "anyOf": [
        {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_LEN},
        {
            "type": "array",
            "maxItems": MAX_STOP_STRINGS,
            "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_LEN},
        },
        {"type": "null"},
    ]
}
_JSON_TYPES = {int: "integer", float: "number", bool: "boolean"}


def _sampling_field(name: str) -> dict[str, Any]:
    """A scalar `SamplingParams` field's schema: its JSON type and its range."""
    spec = sampling_fields()[name]
    schema = {"type": _JSON_TYPES[spec.kinds[-1]], **spec.bounds}
    return _nullable(schema) if spec.nullable else schema


_SAMPLING = {
    "model": {"type": "string"},
    **{
        name: _sampling_field(name)
        for name, spec in sampling_fields().items()
        # logprobs: a number on /v1/completions, a boolean on /v1/chat/completions
        if set(spec.kinds) <= _JSON_TYPES.keys() and name != "logprobs"
    },
    "stop": _STOP,
    "stop_token_ids": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0}}),
    "logit_bias": _nullable(
        {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {
                "type": "number",
                "minimum": -MAX_ABS_LOGIT_BIAS,
                "maximum": MAX_ABS_LOGIT_BIAS,
            },
        }
    ),
    "stream": {"type": "boolean"},
    # vLLM's: lower runs first on a worker whose engine schedules by priority (others take 0)
    "priority": _nullable({"type": "integer", "minimum": -MAX_PRIORITY, "maximum": MAX_PRIORITY}),
    "stream_options": _nullable(
        {"type": "object", "properties": {"include_usage": {"type": "boolean"}}}
    ),
    # vLLM's beam search: n beams (at most engine.beam_search.MAX_BEAM_WIDTH), best first;
    # with it a sampling field other than n, max_tokens, ignore_eos is refused unless at its
    # default (temperature: 0). length_penalty only with it.
    "use_beam_search": _nullable({"type": "boolean"}),
    "length_penalty": _nullable(
        {
            "type": "number",
            "minimum": -MAX_ABS_LENGTH_PENALTY,
            "maximum": MAX_ABS_LENGTH_PENALTY,
        }
    ),
}
# Fields of features still to come: accepted only as their "off" values until then (others
# are refused with "not supported yet"), and never as unknown fields.
_NOT_YET = {
    "anyOf": [
        {"type": "null"},
        {"const": False},
        {"const": ""},
        {"type": "array", "maxItems": 0},
    ]
}
_JSON_SCHEMA = {"type": "object"}  # a JSON schema, checked by xgrammar (400 when it refuses it)
_CHOICE = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}
# One constraint (engine.StructuredOutputsParams), by vLLM's names, or by OpenAI's
# response_format, or by vLLM's older guided_* fields: at most one of these in a request.
_STRUCTURED_OUTPUTS = {
    "structured_outputs": _nullable(
        {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "json": {"anyOf": [_JSON_SCHEMA, {"type": "string"}]},
                "regex": {"type": "string"},
                "choice": _CHOICE,
                "grammar": {"type": "string"},
                "json_object": {"const": True},
                "disable_any_whitespace": {"type": "boolean"},
            },
            "oneOf": [{"required": [kind]} for kind in STRUCTURED_OUTPUT_KINDS],
        }
    ),
    "response_format": _nullable(
        {
            "type": "object",
            "required": ["type"],
            "additionalProperties": False,
            "properties": {
                "type": {"enum": ["text", "json_object", "json_schema"]},
                "json_schema": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "name": {"type": "string"},
                        "description": {"type": "string"},
                        "schema": _JSON_SCHEMA,
                        "strict": _nullable({"type": "boolean"}),
                    },
                },
            },
        }
    ),
    "guided_json": _nullable({"anyOf": [_JSON_SCHEMA, {"type": "string"}]}),
    "guided_regex": _nullable({"type": "string"}),
    "guided_choice": _nullable(_CHOICE),
    "guided_grammar": _nullable({"type": "string"}),
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
    "properties": {
        **{
            name: {"type": "integer", "minimum": 0}
            for name in ("prompt_tokens", "completion_tokens", "total_tokens")
        },
        # cached_tokens: prompt tokens found in the prefix cache
        "prompt_tokens_details": {
            "type": "object",
            "required": ["cached_tokens"],
            "properties": {"cached_tokens": {"type": "integer", "minimum": 0}},
        },
    },
}
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_COMPLETION_REQUEST = {
    "type": "object",
    "required": ["model", "prompt"],
    # Unknown fields are refused (400 naming them) unless KVRAIL_UNKNOWN_FIELDS=warn.
    "additionalProperties": False,
    "properties": {
        **_SAMPLING,
        **_STRUCTURED_OUTPUTS,
        # A batch (an array of prompts) is one engine request per prompt; its choices are
        # numbered prompt_index * n + i.
        "prompt": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                _TOKEN_IDS,
                {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
            ]
        },
        # 0 only with echo: the prompt (and with logprobs, its logprobs) and nothing more
        "max_tokens": _nullable(
            {"type": "integer", **sampling_fields()["max_tokens"].bounds, "minimum": 0}
        ),
        "logprobs": _sampling_field("logprobs"),
        "echo": _nullable({"type": "boolean"}),
        "best_of": _nullable({"type": "integer", "minimum": 1}),  # other than n: 400
        "suffix": _NOT_YET,
    },
}
_TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            # arguments: a JSON object's text
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        # developer: read as system
        "role": {"enum": list(ROLES)},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "null"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {
                            "type": {"const": "text"},
                            "text": {"type": "string"},
                        },
                    },
                },
            ]
        },
        "name": {"type": "string"},
        "tool_calls": _nullable({"type": "array", "items": _TOOL_CALL}),  # assistant
        "tool_call_id": {"type": "string"},  # tool: required
    },
}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "additionalProperties": False,
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "description": {"type": "string"},
                "parameters": _JSON_SCHEMA,
                "strict": _nullable({"type": "boolean"}),
            },
        },
    },
}
_TOOLS = {
    "tools": _nullable({"type": "array", "items": _TOOL}),
    "tool_choice": _nullable(
        {
            "anyOf": [
                {"enum": ["none", "auto", "required"]},
                {
                    "type": "object",
                    "required": ["type", "function"],
                    "properties": {
                        "type": {"const": "function"},
                        "function": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {"name": {"type": "string"}},
                        },
                    },
                },
            ]
        }
    ),
    "parallel_tool_calls": _nullable({"type": "boolean"}),
    # OpenAI's deprecated form of tools: refused, naming tools
    "functions": {"type": "null"},
    "function_call": {"type": "null"},
}
# vLLM's chat template options; add_generation_prompt defaults to true, to false with
# continue_final_message (both true: 400). chat_template_kwargs: variables the model's chat
# template reads (another key is an unknown field).
_CHAT_TEMPLATE_OPTIONS = {
    "add_generation_prompt": _nullable({"type": "boolean"}),
    "continue_final_message": _nullable({"type": "boolean"}),
    "chat_template_kwargs": _nullable({"type": "object"}),
}
_CHAT_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "additionalProperties": False,
    "properties": {
        **_SAMPLING,
        **_STRUCTURED_OUTPUTS,
        **_CHAT_TEMPLATE_OPTIONS,
        **_TOOLS,
        "audio": _NOT_YET,
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_completion_tokens": _sampling_field("max_tokens"),
        "logprobs": {"type": "boolean"},
        "top_logprobs": _sampling_field("logprobs"),
        # kvrail's (extra body): the next turn of this streaming-input session, its messages
        # the new ones only; n 1. 409 when the session cannot take a turn now.
        "session_id": _nullable(
            {"type": "string", "minLength": 1, "maxLength": MAX_ID_LEN, "pattern": "^\\S+$"}
        ),
    },
}
# vLLM's prompt_logprobs: null at position 0, then per position the prompt's token and the
# top-N, keyed by token id.
_PROMPT_LOGPROBS = _nullable(
    {
        "type": "array",
        "items": _nullable(
            {
                "type": "object",
                "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": {
                    "type": "object",
                    "required": ["logprob", "rank", "decoded_token"],
                    "properties": {
                        "logprob": {"type": "number"},
                        "rank": {"type": "integer", "minimum": 1},
                        "decoded_token": {"type": "string"},
                    },
                },
            }
        ),
    }
)
_CHOICE_COMMON = {
    "index": {"type": "integer"},
    "finish_reason": {"type": ["string", "null"]},
    "stop_reason": {"type": ["string", "integer", "null"]},
    "logprobs": {"type": ["object", "null"]},
}


def _response(
    kind: str, choice_props: dict[str, Any], props: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            **(props or {}),
            "id": {"type": "string"},
            "object": {"const": kind},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {"type": "object", "properties": {**_CHOICE_COMMON, **choice_props}},
            },
            "usage": _USAGE,
        },
    }


_SCHEMAS = {
    "Error": _ERROR,
    "Usage": _USAGE,
    "CompletionRequest": _COMPLETION_REQUEST,
    "ChatCompletionRequest": _CHAT_REQUEST,
    "Completion": _response(
        "text_completion", {"text": {"type": "string"}, "prompt_logprobs": _PROMPT_LOGPROBS}
    ),
    "ChatCompletion": _response(
        "chat.completion",
        {
            "message": {
                "type": "object",
                "properties": {
                    "role": {"const": "assistant"},
                    "content": {"type": ["string", "null"]},  # null: only tool calls
                    "tool_calls": {
                        "type": "array",
                        "items": {**_TOOL_CALL, "required": ["id", "type", "function"]},
                    },
                },
            }
        },
        {"prompt_logprobs": _PROMPT_LOGPROBS},
    ),
    "Model": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "max_model_len": {"type": ["integer", "null"]},
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": _ref("Model")},
        },
    },
    "TokenizeRequest": {
        "anyOf": [
            {
                "type": "object",
                "required": ["prompt"],
                "properties": {
                    "model": {"type": "string"},
                    "prompt": {"type": "string"},
                    "add_special_tokens": {"type": "boolean"},
                    "return_token_strs": {"type": "boolean"},
                },
            },
            {
                "type": "object",
                "required": ["messages"],
                "properties": {
                    "model": {"type": "string"},
                    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
                    **_CHAT_TEMPLATE_OPTIONS,
                    "add_special_tokens": {"type": "boolean"},
                    "return_token_strs": {"type": "boolean"},
                },
            },
        ]
    },
    "TokenizeResponse": {
        "type": "object",
        "required": ["count", "max_model_len", "tokens", "token_strs"],
        "properties": {
            "count": {"type": "integer"},
            "max_model_len": {"type": ["integer", "null"]},
            "tokens": {"type": "array", "items": {"type": "integer"}},
            "token_strs": {"type": ["array", "null"], "items": {"type": "string"}},
        },
    },
    "DetokenizeRequest": {
        "type": "object",
        "required": ["tokens"],
        "properties": {
            "model": {"type": "string"},
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        },
    },
    "DetokenizeResponse": {
        "type": "object",
        "required": ["prompt"],
        "properties": {"prompt": {"type": "string"}},
    },
    "Health": {
        "type": "object",
        "required": ["status", "workers"],
        "properties": {"status": {"const": "ok"}, "workers": {"type": "integer"}},
    },
}

_ERROR_TEXT = {
    "400": "Malformed JSON, an unknown field, a wrong type or value (param names it), or a "
    "prompt too long",
    "401": "Missing or wrong bearer API key (when the server has one)",
    "404": "Unknown model",
    "408": "The body did not all arrive within KVRAIL_HTTP_BODY_TIMEOUT_S",
    "413": "Body larger than KVRAIL_MAX_BODY_BYTES",
    "415": "Body not sent as application/json",
    "409": "The session (session_id) cannot take a turn now: closed, its last turn still "
    "running, or the turn taken by another request",
    "429": "Too many requests pending; see Retry-After",
    "500": "The worker failed the request",
    "503": "No worker is alive; see Retry-After",
    "504": "The worker sent nothing within the stream timeout",
}


def _errors(*codes: str) -> dict[str, Any]:
    body = {"application/json": {"schema": _ref("Error")}}
    return {code: {"description": _ERROR_TEXT[code], "content": body} for code in codes}


def _json(schema_name: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": _ref(schema_name)}},
    }


_SSE_EVENT = {
    "type": "object",
    "properties": {
        "data": {"type": "string"},
        "id": {"type": "string"},
        "event": {"type": "string"},
    },
    "required": ["data"],
}


def _sse(description: str) -> dict[str, Any]:
    return {
        "description": description,
        # The schema of one event (as OpenAPI 3.2's `itemSchema`, and as schemathesis checks
        # each event): `data` is a JSON chunk or [DONE], `id` the chunk's seq.
        "content": {"text/event-stream": {"schema": _SSE_EVENT}},
    }


def _generation(
    request_schema: str, response_schema: str, summary: str, *extra_errors: str
) -> dict[str, Any]:
    ok = _json(response_schema, "The whole answer (stream=false)")
    ok["content"] |= _sse("With stream=true: chunks as SSE, each with `id: <seq>`, then [DONE]")[
        "content"
    ]
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}, {}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request_schema)}},
            },
            "responses": {
                "200": ok,
                **_errors("400", "401", "404", "408", "413", "415", "429", "500", "503", "504"),
                **_errors(*extra_errors),
            },
        }
    }


def openapi_document(model_name: str) -> dict[str, Any]:
    """The OpenAPI 3.1 description of every route of `service.api.create_app`."""
    tokenize_body = {
        "required": True,
        "content": {"application/json": {"schema": _ref("TokenizeRequest")}},
    }
    detokenize_body = {
        "required": True,
        "content": {"application/json": {"schema": _ref("DetokenizeRequest")}},
    }
    last_event_id = {
        "name": "Last-Event-ID",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "pattern": r"^(-1|[0-9]+)(\.(-1|[0-9]+))*$"},
        "description": "The last event id received (per prompt, the last seq, joined by "
        "'.'); the stream resumes after it",
    }
    paths = {
        "/v1/completions": _generation("CompletionRequest", "Completion", "Text completion"),
        "/v1/chat/completions": _generation(
            "ChatCompletionRequest", "ChatCompletion", "Chat completion", "409"
        ),
        "/v1/models": {
            "get": {
                "summary": "The served model",
                "security": [{"bearer": []}, {}],
                "responses": {"200": _json("ModelList", "One model"), **_errors("401")},
            }
        },
        "/v1/models/{model}": {
            "get": {
                "summary": "The served model, by its id",
                "security": [{"bearer": []}, {}],
                "parameters": [
                    {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {"200": _json("Model", "The model"), **_errors("401", "404")},
            }
        },
        "/v1/streams/{request_id}": {
            "get": {
                "summary": "Resume a streaming request after Last-Event-ID",
                "security": [{"bearer": []}, {}],
                "parameters": [
                    {
                        "name": "request_id",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string"},
                    },
                    last_event_id,
                ],
                "responses": {
                    "200": _sse("The remaining chunks, then [DONE]"),
                    **_errors("400", "401"),
                    "404": {
                        "description": "Unknown or expired request id",
                        "content": {"application/json": {"schema": _ref("Error")}},
                    },
                },
            }
        },
        "/health": {
            "get": {
                "summary": "Redis answers and a worker is alive",
                "responses": {"200": _json("Health", "Healthy"), **_errors("503")},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {
                        "description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/tokenize": {
            "post": {
                "summary": "Tokenize a prompt or chat messages",
                "security": [{"bearer": []}, {}],
                "requestBody": tokenize_body,
                "responses": {
                    "200": _json("TokenizeResponse", "Token ids"),
                    **_errors("400", "401", "404", "408", "413", "415"),
                },
            }
        },
        "/detokenize": {
            "post": {
                "summary": "Token ids to text",
                "security": [{"bearer": []}, {}],
                "requestBody": detokenize_body,
                "responses": {
                    "200": _json("DetokenizeResponse", "The text"),
                    **_errors("400", "401", "404", "408", "413", "415"),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {
                    "200": {
                        "description": "OpenAPI 3.1",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    }
                },
            }
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvrail", "version": "0.1.0", "description": f"Serving {model_name}"},
        "paths": paths,
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
