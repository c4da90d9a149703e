"""The one way a conversation becomes prompt tokens: `LLM.chat`, the worker and the API all
call `apply_chat_template`, so a chat request tokenizes the same wherever it is counted.

`chat_template_variables` says which template variables a caller may set through
`template_kwargs` (vLLM's `chat_template_kwargs`): a key the template never reads would
change nothing, so the API can refuse it rather than ignore it.
"""

from __future__ import annotations

import inspect
from typing import Any

import jinja2.meta
from transformers import PreTrainedTokenizerBase

# transformers compiles a template in its own sandboxed environment, with the extensions
# (loop controls, `{% generation %}`) its templates use: parsed anywhere else, some fail.
from transformers.utils.chat_template_utils import _compile_jinja_template


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
    **template_kwargs: Any,
) -> tuple[str, list[int]]:
    """The conversation rendered by the model's chat template, and its token ids.

    The template already writes any BOS, so special tokens are not added again unless asked
    (adding them would double BOS). A model without a template raises `ValueError`; a
    template may raise anything of its own (jinja errors, its checks on the messages).
    `template_kwargs` go to `tokenizer.apply_chat_template`: its own options
    (`continue_final_message`) and the template's variables.
    """
    if not tokenizer.chat_template:
        raise ValueError("this model has no chat template")
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)


def chat_template_variables(tokenizer: PreTrainedTokenizerBase) -> frozenset[str]:
    """The variables of the model's chat template that a caller can set: those it reads,
    less the ones rendering sets itself (`messages`, `add_generation_prompt`, and any other
    option of `apply_chat_template`, which a key of that name would set instead). Empty
    without a template."""
    if not tokenizer.chat_template:
        return frozenset()
    source = tokenizer.get_chat_template()
    environment = _compile_jinja_template(source).environment
    read = jinja2.meta.find_undeclared_variables(environment.parse(source))
    options = inspect.signature(tokenizer.apply_chat_template).parameters
    return frozenset(read - set(options) - {"messages"})
