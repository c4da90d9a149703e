"""kvrail inference engine: a paged KV cache, a token-budget scheduler, Llama-family models.

The public API matches vLLM's, so code can switch between the two:
    from engine import LLM, SamplingParams
"""

from engine.chat_template import apply_chat_template
from engine.config import EngineConfig
from engine.llm_engine import LLM, LLMEngine
from engine.loader import served_model_name
from engine.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput, UnfinishedRequest
from engine.request import FinishReason, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "UnfinishedRequest",
    "apply_chat_template",
    "served_model_name",
]
