"""Prompt lookup: drafts copied from the request's own text, with no model at all.

A request that quotes, edits or converts text given in its prompt produces long runs that
already occur in its context. After each step the proposer takes the request's last n tokens
(n from `prompt_lookup_max` down to `prompt_lookup_min`), finds their latest earlier
occurrence in its prompt and output, and proposes the k tokens that followed it. The longest
suffix that matches wins: more context, fewer wrong guesses.

The search runs in every step of every request with speculation on, beside steps of 11-28 ms,
so it is one pass over the context and then work on its matches alone: the places where the
last token occurred before are the candidates for n = 1, and each longer n keeps those whose
previous token also matches. On the grounded set of `benchmarks.spec_decode` (contexts of
200-500 tokens; k = 5, lookup 1-4; a Zen 3 EPYC) that took the runner's proposal from 0.33-0.40
ms a step, comparing every window of the context for each n, to 0.07-0.08 ms.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: np.ndarray) -> list[int]:
        """Up to k drafts continuing `token_ids` (a request's prompt + output, 1-D); none when
        no suffix of `lookup_min`..`lookup_max` tokens occurred before."""
        num_tokens = len(token_ids)
        # ends: where an earlier occurrence of the last n tokens ends (its continuation starts
        # one later, so the context's last token cannot end one).
        ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])
        best = ends if self.lookup_min <= 1 else None
        for n in range(2, min(self.lookup_max, num_tokens - 1) + 1):
            ends = ends[ends >= n - 1]
            ends = ends[token_ids[ends - (n - 1)] == token_ids[-n]]
            if not len(ends):
                break
            if n >= self.lookup_min:
                best = ends
        if best is None or not len(best):
            return []
        start = int(best[-1]) + 1
        return token_ids[start : start + self.k].tolist()
