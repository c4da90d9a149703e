"""kvrail inference engine: a paged KV cache, a token-budget scheduler, Llama-family models.

The public API matches vLLM's, so code can switch between the two:
    from engine import LLM, SamplingParams
"""

from engine import envs

envs.prefer_huge_pages()  # before anything below imports torch

from engine.beam_search import (
    MAX_ABS_LENGTH_PENALTY,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
)
from engine.chat_template import (
    apply_chat_continuation,
    apply_chat_template,
    chat_template_variables,
)
from engine.config import EngineConfig
from engine.detokenizer import TokenBytes
from engine.llm_engine import LLM, LLMEngine
from engine.loader import load_tokenizer, resolve_model
from engine.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput, UnfinishedRequest
from engine.request import (
    MAX_ABS_LOGIT_BIAS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    FinishReason,
    SamplingField,
    SamplingParams,
    sampling_fields,
    value_kinds,
)
from engine.structured_outputs import KINDS as STRUCTURED_OUTPUT_KINDS
from engine.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "MAX_ABS_LENGTH_PENALTY",
    "MAX_ABS_LOGIT_BIAS",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_LEN",
    "STRUCTURED_OUTPUT_KINDS",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingField",
    "SamplingParams",
    "StructuredOutputsParams",
    "TokenBytes",
    "UnfinishedRequest",
    "apply_chat_continuation",
    "apply_chat_template",
    "chat_template_variables",
    "load_tokenizer",
    "resolve_model",
    "sampling_fields",
    "value_kinds",
]
