"""kvrail inference engine: a paged KV cache, a token-budget scheduler, Llama-family models.

The public API matches vLLM's, so code can switch between the two:
    from engine import LLM, SamplingParams
"""

from engine.chat_template import apply_chat_template
from engine.config import EngineConfig
from engine.llm_engine import LLM, LLMEngine
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.request import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "apply_chat_template",
]
