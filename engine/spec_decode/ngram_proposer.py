"""Prompt lookup: drafts copied from the request's own text, with no model at all.

A request that quotes, edits or converts text given in its prompt produces long runs that
already occur in its context. After each step the proposer takes the request's last n tokens
(n from `prompt_lookup_max` down to `prompt_lookup_min`), finds their latest earlier
occurrence in its prompt and output, and proposes the k tokens that followed it. The longest
suffix that matches wins: more context, fewer wrong guesses. The search is one vectorised
comparison of every window of the context with the suffix (numpy), O(n * context) per request.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: np.ndarray) -> list[int]:
        """Up to k drafts continuing `token_ids` (a request's prompt + output, 1-D); none when
        no suffix of `lookup_min`..`lookup_max` tokens occurred before."""
        num_tokens = len(token_ids)
        for n in range(min(self.lookup_max, num_tokens - 1), self.lookup_min - 1, -1):
            # Windows of the context without its last token: each has a continuation.
            windows = sliding_window_view(token_ids[:-1], n)
            matches = np.flatnonzero((windows == token_ids[-n:]).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return token_ids[start : start + self.k].tolist()
        return []
