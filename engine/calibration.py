"""The calibration text: what quantization measures activations on (SmoothQuant's smoothing
factors, the fp8 KV cache's scales).

English that ships with every Python, so a calibration is the same on every machine without
a download: the docstrings of a few standard-library modules. Not `pydoc_data.topics`, which
`benchmarks/quality.py` evaluates perplexity on.
"""

from __future__ import annotations

import collections
import difflib
import heapq
import itertools
import json
import typing

# Prose first: json's docstring alone is 950 tokens, most of them doctest code.
CALIBRATION_MODULES = (collections, typing, heapq, difflib, itertools, json)
NUM_CALIBRATION_TOKENS = 1024


def calibration_text() -> str:
    docs = [module.__doc__ for module in CALIBRATION_MODULES]
    if not all(docs):
        raise RuntimeError("calibration needs the standard library's docstrings (not python -OO)")
    return "\n\n".join(docs)


def calibration_token_ids(tokenizer, max_tokens: int = NUM_CALIBRATION_TOKENS) -> list[int]:
    return tokenizer.encode(calibration_text(), add_special_tokens=False)[:max_tokens]
