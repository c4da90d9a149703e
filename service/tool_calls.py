"""Tool calls out of a chat completion's text: OpenAI's `tool_choice`, as vLLM serves it.

- A named function (`tool_choice: {"type": "function", ...}`) and `required` are constrained
  by the engine's structured outputs to JSON that matches the tools' `parameters` schemas
  (`tool_constraint`), so their calls are always valid: a named call's whole text is its
  arguments; `required` writes vLLM's form, a JSON array of `{"name", "parameters"}` (one item
  at most when `parallel_tool_calls` is false), each call sent once its object is complete.
- `auto` lets the model choose, and reads its calls in either of two conventions: Hermes',
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the text (Qwen 2.5
  and Hermes write it, and `engine.apply_chat_template` teaches it to templates without
  tools), and Llama 3.1's, an answer that is nothing but `{"name": ..., "parameters": {...}}`
  objects (";"-separated for several). A block or an answer whose JSON is not a call stays
  text. An answer that begins with `{` is held until it ends, to know which it is.

One parser, `ToolCallParser`, makes both kinds of answer: a stream sends what it returns for
each chunk's text as deltas, and a whole answer is what it returned over all the text, so the
two never disagree. It is deterministic, so a stream resumed after `Last-Event-ID` replays
every chunk through a new one and continues where the client was. A call's id is derived
from the request, the choice and the call's index for the same reason.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_DECODER = json.JSONDecoder()
Mode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class ToolChoice:
    """How a request's choices make tool calls; `tool_choice: "none"` has none."""

    mode: Mode
    name: str | None = None  # named: the function called


def tool_constraint(
    tools: list[dict[str, Any]], choice: ToolChoice, parallel_tool_calls: bool
) -> dict[str, Any] | None:
    """The structured-outputs constraint (the wire map of `engine.StructuredOutputsParams`)
    that makes a `required` or named choice's text valid calls; None for `auto`. Raises
    `ValueError` when two tools' schemas define one `$defs` name two ways."""
    schemas = {t["function"]["name"]: parameters_schema(t["function"]) for t in tools}
    if choice.mode == "named":
        return {"json": schemas[choice.name]}
    if choice.mode == "auto":
        return None
    # Each schema's `$ref`s point into its own root's `$defs`: the array's root takes them all.
    defs: dict[str, Any] = {}
    calls = []
    for name, schema in schemas.items():
        for key, definition in schema.get("$defs", {}).items():
            if defs.setdefault(key, definition) != definition:
                raise ValueError(f"the tools' parameters define '$defs/{key}' differently")
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"enum": [name]},
                    "parameters": {k: v for k, v in schema.items() if k != "$defs"},
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    array |= {} if parallel_tool_calls else {"maxItems": 1}
    return {"json": array | ({"$defs": defs} if defs else {})}


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's arguments schema; OpenAI reads a function without `parameters` as one
    that takes none."""
    return function.get("parameters") or {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }


def call_id(request_id: str, choice_index: int, call_index: int) -> str:
    """A tool call's id, the same every time the call is shaped (streams resume)."""
    digest = hashlib.sha256(f"{request_id}/{choice_index}/{call_index}".encode()).hexdigest()
    return f"call_{digest[:24]}"


@dataclass
class ToolCallDelta:
    """A piece of one call: the first piece of a call carries its id and name; the pieces'
    `arguments` joined are the call's JSON arguments."""

    index: int  # the call's position among the choice's calls
    id: str | None
    name: str | None
    arguments: str

    def to_json(self) -> dict[str, Any]:
        """OpenAI's `delta.tool_calls[]` entry."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.index, "id": self.id, "type": "function", "function": function}


@dataclass
class ToolCall:
    """A whole call, as `message.tool_calls[]` has it."""

    id: str
    name: str
    arguments: str

    def to_json(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass
class ToolCallParser:
    """Turns a choice's text, as it comes, into content and tool-call deltas."""

    choice: ToolChoice
    request_id: str
    choice_index: int
    num_calls: int = 0
    _buffer: str = ""
    _in_call: bool = False  # auto: after a `<tool_call>` whose end has not come
    _space: str = ""  # auto: trailing whitespace of the content, not sent yet
    _pos: int = 0  # required: where the array's next call begins in the text
    _lead: str | None = None  # auto: "json" (an answer that begins with "{"), "text", or unknown

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The content and the call deltas this much more text makes."""
        if self.choice.mode == "named":
            return "", self._named(text)
        self._buffer += text
        if self.choice.mode == "required":
            return self._required(final=False)
        return self._auto(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is left when the choice's text ends."""
        if self.choice.mode == "named":
            return "", []
        if self.choice.mode == "required":
            return self._required(final=True)
        return self._auto(final=True)

    def _new_call(self, name: str, arguments: str) -> ToolCallDelta:
        delta = ToolCallDelta(
            self.num_calls,
            call_id(self.request_id, self.choice_index, self.num_calls),
            name,
            arguments,
        )
        self.num_calls += 1
        return delta

    def _named(self, text: str) -> list[ToolCallDelta]:
        if self.num_calls == 0:
            return [self._new_call(self.choice.name, text)]
        return [ToolCallDelta(0, None, None, text)] if text else []

    def _required(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """Each call of the JSON array as soon as its object is complete, so a stream sends
        calls one by one and an array cut short (max_tokens) keeps the calls it completed;
        text that made no call is content."""
        deltas = []
        while True:
            start = self._pos
            while start < len(self._buffer) and self._buffer[start] in " \t\r\n,[":
                start += 1
            try:
                item, self._pos = _DECODER.raw_decode(self._buffer, start)
                name, arguments = item["name"], item["parameters"]
            except (ValueError, TypeError, KeyError):  # not complete yet, or not a call
                break
            deltas.append(self._new_call(name, _dumps(arguments)))
        if final and not self.num_calls:
            return self._buffer, []
        return "", deltas

    def _auto(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        if self._lead is None:
            stripped = self._buffer.lstrip()
            if not stripped and not final:
                return "", []
            self._lead = "json" if stripped.startswith("{") else "text"
        if self._lead == "json":
            if not final:
                return "", []
            self._lead = "text"  # read as text unless it is calls
            calls = _json_calls(self._buffer)
            if calls is not None:
                self._buffer = ""
                return "", [self._new_call(name, arguments) for name, arguments in calls]
        content, deltas = "", []
        while True:
            if not self._in_call:
                start = self._buffer.find(TOOL_CALL_START)
                if start < 0:
                    keep = 0 if final else _partial_suffix(self._buffer, TOOL_CALL_START)
                    content += self._text(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content += self._text(self._buffer[:start])
                self._buffer = self._buffer[start + len(TOOL_CALL_START) :]
                self._in_call = True
            end = self._buffer.find(TOOL_CALL_END)
            if end < 0 and not final:
                break
            block = self._buffer if end < 0 else self._buffer[:end]
            self._buffer = "" if end < 0 else self._buffer[end + len(TOOL_CALL_END) :]
            self._in_call = False
            call = _hermes_call(block)
            if call is None:  # not a call: the text as it was
                content += self._text(TOOL_CALL_START + block + ("" if end < 0 else TOOL_CALL_END))
            else:
                self._space = ""  # the whitespace before a call is not content
                deltas.append(self._new_call(*call))
            if end < 0:
                break
        if final and not self.num_calls:
            content, self._space = content + self._space, ""
        return content, deltas

    def _text(self, text: str) -> str:
        """Content to send, less its trailing whitespace, held until more content follows
        (so a stream and a whole answer drop the same whitespace around calls)."""
        text = self._space + text
        sent = text.rstrip()
        self._space = text[len(sent) :]
        return sent


def _hermes_call(block: str) -> tuple[str, str] | None:
    """(name, JSON arguments) of a `<tool_call>` block, or None when it is not one."""
    try:
        return _call_of(json.loads(block), needs_arguments=False)
    except ValueError:
        return None


def _json_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, JSON arguments) of each call of an answer in Llama 3.1's convention (only
    `{"name", "parameters"}` objects, ";" or whitespace between them), or None when it is not."""
    calls, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos == len(text):
            return calls or None
        try:
            item, pos = _DECODER.raw_decode(text, pos)
        except ValueError:
            return None
        call = _call_of(item, needs_arguments=True)
        if call is None:
            return None
        calls.append(call)


def _call_of(item: Any, needs_arguments: bool) -> tuple[str, str] | None:
    """(name, JSON arguments) of a decoded call object (`arguments` or `parameters`; JSON
    text or an object), or None when it is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters"))
    if arguments is None and not needs_arguments:
        arguments = {}
    if isinstance(arguments, str) and not needs_arguments:
        return item["name"], arguments
    return (item["name"], _dumps(arguments)) if isinstance(arguments, dict) else None


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (held back: the marker
    may be arriving)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def whole_answer(parser: ToolCallParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A choice's message content (None when it is only calls) and its calls, from its text."""
    content, calls = [], []
    for piece, deltas in (parser.feed(text), parser.finish()):
        content.append(piece)
        for delta in deltas:
            if delta.id is not None:
                calls.append(ToolCall(delta.id, delta.name, delta.arguments))
            else:
                calls[delta.index].arguments += delta.arguments
    joined = "".join(content)
    return (None if calls and not joined else joined), calls
