"""The one way a conversation becomes prompt tokens: `LLM.chat`, the worker and the API all
call `apply_chat_template`, so a chat request tokenizes the same wherever it is counted."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase


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
    """
    if not tokenizer.chat_template:
        raise ValueError("this model has no chat template")
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)
