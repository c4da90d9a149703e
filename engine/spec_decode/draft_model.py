"""Draft-model proposals: a smaller model with the target's vocabulary guesses k tokens.

The draft model keeps its own paged KV cache, with the same number of blocks as the target's
and addressed by the target's block tables, so one allocation (the scheduler's, with
`num_lookahead_tokens` = k slots past each step for the drafts' KV) serves both, and
preemption, prefix-cache hits and freeing need nothing of their own. The draft catches up
lazily: it remembers up to where it has computed each request and, after a step, runs the
request's new tokens (all of its prompt the first time) in one ragged pass whose last row
gives draft 1, then k - 1 single-token passes for drafts 2..k. A block filled while the draft
was not running (a prefix-cache hit on text the draft never saw) only lowers acceptance:
verification keeps the output the target's.

Drafts are the draft model's greedy tokens: verification treats them as certain (q one-hot),
which keeps sampling exact (`rejection_sampler`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention import KVCacheSpec, set_forward_context
from engine.loader import load_model, resolve_model
from engine.models.layers import model_kernels
from engine.quantization import get_linear_method
from engine.sampler import argmax_rows

if TYPE_CHECKING:
    from engine.model_runner import CachedRequestState, ModelRunner

logger = logging.getLogger("kvrail.spec_decode")


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, model: str, num_speculative_tokens: int) -> None:
        self.runner = runner
        self.k = num_speculative_tokens
        self.model, config = load_model(
            resolve_model(model),
            runner.dtype,
            runner.device,
            runner.attn_backend,
            get_linear_method(
                None, model_kernels(runner.attn_backend.name), runner.device, runner.dtype
            ),
        )
        if config.vocab_size != runner.vocab_size:
            raise ValueError(
                f"speculative_config model {model!r} has vocab_size {config.vocab_size}, the "
                f"target has {runner.vocab_size}: a draft model must share the target's "
                "vocabulary"
            )
        self.model.process_weights()
        # The draft's cache is in its dtype (an fp8 cache would need its own calibration).
        self.kv_cache_spec: KVCacheSpec = dataclasses.replace(
            self.model.get_kv_cache_spec(), dtype=runner.dtype
        )
        self.num_computed: dict[str, int] = {}  # req_id -> tokens whose draft KV is written
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def initialize_kv_cache(self, num_blocks: int) -> None:
        runner = self.runner
        self.kv_caches = self.kv_cache_spec.allocate(num_blocks, runner.block_size, runner.device)
        self.model.bind_kv_cache(self.kv_caches)

    def reset(self, req_id: str, num_computed_tokens: int) -> None:
        """The request's blocks were (re)assigned: its draft KV is valid up to the target's."""
        self.num_computed[req_id] = num_computed_tokens

    def forget(self, req_id: str) -> None:
        self.num_computed.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState]) -> list[list[int]]:
        """Up to k greedy drafts per request, each continuing its known tokens; fewer where
        its allocated blocks (or max_model_len) end."""
        runner = self.runner
        drafts: list[list[int]] = [[] for _ in states]
        ends = np.array([s.num_tokens for s in states], dtype=np.int64)
        # Draft i's KV lands at position end + i - 1: within the allocated blocks.
        capacity = np.array(
            [min(len(s.block_ids) * runner.block_size, runner.max_model_len) for s in states]
        )
        num_drafts = np.minimum(self.k, capacity - ends + 1)
        active = np.flatnonzero(num_drafts > 0)
        if not len(active):
            return drafts
        rows = np.array([states[i].row for i in active], dtype=np.int64)
        starts = np.array([min(self.num_computed.get(states[i].req_id, 0), ends[i] - 1)
                           for i in active], dtype=np.int64)  # fmt: skip
        num_new = ends[active] - starts
        for step in range(self.k):
            input_ids, positions, common = runner.build_batch(rows, starts, num_new)
            with set_forward_context(runner.attn_backend.build(common)):
                hidden_states = self.model(input_ids, positions)
            last_rows = common.query_start_loc_cpu[1:].long() - 1
            tokens = argmax_rows(self.model.compute_logits(hidden_states[last_rows])).tolist()
            if step == 0:
                for i in active:
                    self.num_computed[states[i].req_id] = int(ends[i])
            for j, i in enumerate(active):
                drafts[i].append(tokens[j])
            keep = num_drafts[active] > step + 1
            active, rows = active[keep], rows[keep]
            if not len(active):
                break
            # The next pass reads its input where the draft goes; the step that verifies the
            # drafts writes them (or the real tokens) there again.
            runner.token_ids_cpu[rows, ends[active] + step] = [drafts[i][-1] for i in active]
            starts = ends[active] + step
            num_new = np.ones(len(active), dtype=np.int64)
        return drafts
