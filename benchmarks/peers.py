"""The systems a user would pick instead of kvrail, each running a list of `BenchRequest`s.

Every peer generates exactly `output_len` tokens per request (EOS suppressed, greedy) and
returns the wall time in seconds; the caller turns it into tokens per second.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from benchmarks.common import BenchRequest

LLAMA_CPP_INSTALL = "benchmarks/README.md, 'llama.cpp, the peer'"


class HFRunner:
    """HF transformers `generate` on one model folder, one or several dtypes loaded lazily."""

    def __init__(self, model_dir: Path, pad_token_id: int) -> None:
        self.model_dir = model_dir
        self.pad_token_id = pad_token_id
        self._models: dict[str, Any] = {}

    def model(self, dtype: str) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        if dtype not in self._models:
            self._models[dtype] = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=getattr(torch, dtype)
            ).eval()
        return self._models[dtype]

    def run_serial(self, dtype: str, requests: Sequence[BenchRequest], desc: str = "") -> float:
        """One request at a time, as a script calling `generate` in a loop would."""
        start = time.perf_counter()
        for request in tqdm(requests, desc=desc or f"hf serial {dtype}", disable=not desc):
            self._generate(dtype, [request], request.output_len)
        return time.perf_counter() - start

    def run_static(
        self, dtype: str, requests: Sequence[BenchRequest], batch_size: int, desc: str = ""
    ) -> float:
        """Static batches of `batch_size`, left-padded, each run to its longest output."""
        start = time.perf_counter()
        batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
        for batch in tqdm(batches, desc=desc or f"hf static {dtype}", disable=not desc):
            self._generate(dtype, batch, max(r.output_len for r in batch))
        return time.perf_counter() - start

    def _generate(self, dtype: str, batch: Sequence[BenchRequest], num_new_tokens: int) -> None:
        import torch

        width = max(r.prompt_len for r in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, request in enumerate(batch):  # left padding: every prompt ends at the edge
            input_ids[row, width - request.prompt_len :] = torch.tensor(request.prompt_token_ids)
            attention_mask[row, width - request.prompt_len :] = 1
        with torch.inference_mode():
            self.model(dtype).generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=num_new_tokens,
                min_new_tokens=num_new_tokens,  # suppresses EOS, like ignore_eos
                do_sample=False,
                pad_token_id=self.pad_token_id,
            )

    def choose_dtype(
        self, dtypes: Sequence[str], probe: Sequence[BenchRequest], batch_size: int | None
    ) -> str:
        """The fastest of `dtypes` on `probe` (serially, or as batches), each warmed up first.

        On this CPU the answer differs by batch size (field notes: fp32 wins at batch 1,
        bf16 at batch 16), so each peer is measured at its own faster dtype. With a single
        dtype this is only the warm-up.
        """
        run = (
            self.run_serial
            if batch_size is None
            else partial(self.run_static, batch_size=batch_size)
        )
        times = {}
        for dtype in dtypes:
            run(dtype, probe)  # warm-up: first calls allocate and pick kernels
            times[dtype] = run(dtype, probe)
        return min(times, key=times.get)


def llama_cpp_available() -> bool:
    """llama-cpp-python is installed and finds its llama.cpp library (LLAMA_CPP_LIB_PATH)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return False
    try:
        import llama_cpp  # noqa: F401
    except (OSError, RuntimeError, FileNotFoundError):
        return False
    return True


def run_llama_cpp(gguf_path: Path, requests: Sequence[BenchRequest], n_ctx: int) -> float:
    """llama.cpp through llama-cpp-python, one request at a time, greedy, EOS ignored."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf_path),
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=os.cpu_count(),
        verbose=False,
    )
    _llama_generate(llm, requests[0].prompt_token_ids[:16], 4)  # warm-up
    start = time.perf_counter()
    for request in tqdm(requests, desc="llama.cpp serial"):
        _llama_generate(llm, request.prompt_token_ids, request.output_len)
    return time.perf_counter() - start


def _llama_generate(llm: Any, prompt: list[int], num_new_tokens: int) -> None:
    # `generate` yields tokens without stopping at EOS, so counting them is ignore_eos; reset()
    # first so no prefix of the previous request is reused.
    llm.reset()
    for count, _token in enumerate(llm.generate(prompt, temp=0.0, top_k=1, reset=True), 1):
        if count >= num_new_tokens:
            break
