"""The one way a conversation becomes prompt tokens: `LLM.chat`, the worker and the API all
call `apply_chat_template`, so a chat request tokenizes the same wherever it is counted.

`chat_template_variables` says which template variables a caller may set through
`template_kwargs` (vLLM's `chat_template_kwargs`): a key the template never reads would
change nothing, so the API can refuse it rather than ignore it.

Tools (OpenAI's function definitions) and a history of tool calls render through the
model's own template when it reads `tools`, as the tool-trained templates do (they take a
call's `arguments` as an object, as transformers documents). A template that does not (the
default SmolLM2's ChatML is one) would drop them, so they are written in Hermes' convention
instead, the one `service.tool_calls` parses back: the tools in a `<tools>` block of the
system message, each earlier call as `<tool_call>{"name", "arguments"}</tool_call>` in its
assistant message, each tool's answer in `<tool_response>` tags.

A session's later turn (`apply_chat_continuation`) is templated as a continuation of the
tokens so far: the end of the assistant's turn, then the new messages and the generation
prompt, with the generated tokens left as they are (see its docstring).
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any

import jinja2.meta
from transformers import PreTrainedTokenizerBase

# transformers compiles a template in its own sandboxed environment, with the extensions
# (loop controls, `{% generation %}`) its templates use: parsed anywhere else, some fail.
from transformers.utils.chat_template_utils import _compile_jinja_template

HERMES_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> tuple[str, list[int]]:
    """The conversation rendered by the model's chat template, and its token ids.

    The template already writes any BOS, so special tokens are not added again unless asked
    (adding them would double BOS). A model without a template raises `ValueError`; a
    template may raise anything of its own (jinja errors, its checks on the messages).
    `tools` are OpenAI's `{"type": "function", "function": {...}}` entries; assistant
    messages may hold `tool_calls` (arguments as objects) and `tool` messages answer them.
    `template_kwargs` go to `tokenizer.apply_chat_template`: its own options
    (`continue_final_message`) and the template's variables.
    """
    if not tokenizer.chat_template:
        raise ValueError("this model has no chat template")
    if "tools" in _read_variables(tokenizer.get_chat_template()):
        template_kwargs["tools"] = tools
    elif tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = hermes_messages(messages, tools)
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)


# The stand-in answer whose end the template's end of an assistant turn follows.
_ANSWER = "kvrail-session-answer"


def apply_chat_continuation(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    history_token_ids: list[int],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> tuple[str, list[int]]:
    """The prompt of a session's next turn, after `history_token_ids` (the conversation so
    far, ending with the assistant's generated answer): what the template writes after an
    assistant's answer (its end of turn: ChatML's `<|im_end|>\n`), then `messages` as it
    renders them there, then the generation prompt. Options as `apply_chat_template`'s.

    A template renders whole conversations, so this is the difference between two renders, of
    a stand-in exchange (a user message, an assistant answer) and of the same followed by
    `messages`; a template that does not render the first as the start of the second cannot
    continue a conversation (`ValueError`). The history keeps its tokens: re-sent as text, the
    answer would be tokenized again, and its last tokens and the turn boundary may come out
    otherwise than generated. When the history already ends with the first tokens of the end
    of turn (the model stopped on its end-of-turn token, SmolLM2's EOS `<|im_end|>`), they are
    not written twice. Returns the continuation's text and token ids.
    """
    stand_in = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ANSWER}]
    options = dict(tools=tools, **template_kwargs)
    before = apply_chat_template(tokenizer, stand_in, add_generation_prompt=False, **options)[0]
    after = apply_chat_template(
        tokenizer,
        stand_in + messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **options,
    )[0]
    if _ANSWER not in before or not after.startswith(before):
        raise ValueError("this model's chat template cannot continue a conversation")
    end_of_turn = before[before.index(_ANSWER) + len(_ANSWER) :]
    token_ids = tokenizer.encode(end_of_turn + after[len(before) :], add_special_tokens=False)
    num_end_ids = len(tokenizer.encode(end_of_turn, add_special_tokens=False))
    overlap = next(
        (
            n
            for n in range(min(num_end_ids, len(history_token_ids)), 0, -1)
            if history_token_ids[-n:] == token_ids[:n]
        ),
        0,
    )
    token_ids = token_ids[overlap:]
    return tokenizer.decode(token_ids), token_ids


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """`messages` with the tools, tool calls and tool answers written as Hermes' text, for a
    template that renders only each message's role and string content."""
    out = []
    for message in messages:
        content = message.get("content") or ""
        calls = [
            "<tool_call>\n"
            + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            + "\n</tool_call>"
            for c in message.get("tool_calls") or []
        ]
        if calls:
            content = "\n".join([content, *calls] if content else calls)
        if message["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": message["role"], "content": content})
    if tools:
        prompt = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def chat_template_variables(tokenizer: PreTrainedTokenizerBase) -> frozenset[str]:
    """The variables of the model's chat template that a caller can set: those it reads,
    less the ones rendering sets itself (`messages`, `add_generation_prompt`, and any other
    option of `apply_chat_template`, such as `tools`, which a key of that name would set
    instead). Empty without a template."""
    if not tokenizer.chat_template:
        return frozenset()
    options = inspect.signature(tokenizer.apply_chat_template).parameters
    return _read_variables(tokenizer.get_chat_template()) - set(options) - {"messages"}


@functools.lru_cache(maxsize=8)
def _read_variables(source: str) -> frozenset[str]:
    """The variables a template reads (compiling one takes milliseconds: once per template)."""
    environment = _compile_jinja_template(source).environment
    return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(source)))
