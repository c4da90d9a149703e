"""Verification of draft tokens: which of them the target model would have produced.

For a request with s drafts d_1..d_s, the target's step gives s + 1 rows of logits: row j
scores the token after d_1..d_j (row 0 the token after the known ones). Each row is processed
like any sampled row (min_tokens, logit_bias, penalties counting the drafts before it), so
every verified position sees what a plain decode at that position would have seen.

- Greedy requests accept drafts while they equal the row's argmax, then take the argmax of
  the first mismatching row, or of row s (a bonus token) if all matched: exactly the tokens
  greedy decoding gives without speculation.
- Sampled requests use rejection sampling (Leviathan et al. 2023): accept d_j with
  probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from the normalised
  (p_j - q_j)+, after all acceptances draw the bonus from p_s. Every emitted token is then a
  draw from the target's p, whatever q is. The drafts of both proposers are deterministic
  (q_j one-hot at d_j): accept with p_j(d_j), resample from p_j without d_j.

A seeded request draws everything from its own generator, in a fixed order (its s
acceptance uniforms, then one exponential race), so its tokens do not depend on its batch.
"""

from __future__ import annotations

import torch

from engine.sampler import random_sample


def rejection_sample(
    draft_token_ids: list[list[int]],
    target_argmax: list[int],
    target_probs: torch.Tensor | None,
    is_greedy: list[bool],
    generators: dict[int, torch.Generator],
    draft_probs: torch.Tensor | None = None,
) -> list[list[int]]:
    """The tokens each request emits: its accepted drafts, then one token of the target.

    draft_token_ids: [R][s_r], request r's drafts; its rows are the s_r + 1 rows starting at
        sum of (s_i + 1) over the requests before it.
    target_argmax: [sum(s_r + 1)], each row's argmax of the processed logits (used by greedy
        requests).
    target_probs: [sum(s_r + 1), V] float32, each row's sampling distribution (used by the
        sampled requests); None when every request is greedy.
    is_greedy: [R]. generators: request index -> its generator (seeded sampled requests).
    draft_probs: [sum(s_r), V] float32, q at each draft position; None: q is one-hot.
    """
    starts, draft_starts = [], []
    row = draft_row = 0
    for drafts in draft_token_ids:
        starts.append(row)
        draft_starts.append(draft_row)
        row += len(drafts) + 1
        draft_row += len(drafts)
    outputs: list[list[int]] = [[] for _ in draft_token_ids]
    random_reqs = []
    for r, drafts in enumerate(draft_token_ids):
        if not is_greedy[r]:
            random_reqs.append(r)
            continue
        num_accepted = 0
        while num_accepted < len(drafts) and (
            target_argmax[starts[r] + num_accepted] == drafts[num_accepted]
        ):
            num_accepted += 1
        outputs[r] = [*drafts[:num_accepted], target_argmax[starts[r] + num_accepted]]
    if not random_reqs:
        return outputs
    assert target_probs is not None, "sampled requests need target_probs"

    # Acceptance: one uniform per draft, from the request's generator when it has one.
    rows = [starts[r] + j for r in random_reqs for j in range(len(draft_token_ids[r]))]
    draft_rows = [draft_starts[r] + j for r in random_reqs for j in range(len(draft_token_ids[r]))]
    tokens = [t for r in random_reqs for t in draft_token_ids[r]]
    uniforms = torch.empty(len(rows), dtype=torch.float32, device=target_probs.device)
    offset = 0
    for r in random_reqs:
        num_drafts = len(draft_token_ids[r])
        uniforms[offset : offset + num_drafts].uniform_(generator=generators.get(r))
        offset += num_drafts
    accepted: list[bool] = []
    if rows:
        token_index = torch.tensor(tokens, dtype=torch.int64, device=target_probs.device)
        p = target_probs[rows].gather(1, token_index[:, None])[:, 0]
        q = (
            draft_probs[draft_rows].gather(1, token_index[:, None])[:, 0]
            if draft_probs is not None
            else torch.ones_like(p)
        )
        # u < p / q, without dividing by a q of 0 (a draft q could not have proposed).
        accepted = (uniforms * q < p).tolist()

    # The last token: from (p - q)+ at the first rejected row, or from p at the bonus row.
    final_rows, rejected, offset = [], [], 0
    for r in random_reqs:
        num_drafts = len(draft_token_ids[r])
        verdicts = accepted[offset : offset + num_drafts]
        num_accepted = verdicts.index(False) if False in verdicts else num_drafts
        outputs[r] = draft_token_ids[r][:num_accepted]
        final_rows.append(starts[r] + num_accepted)
        rejected.append(num_accepted < num_drafts)
        offset += num_drafts
    probs = target_probs[final_rows]  # a copy: adjusted below
    for i, r in enumerate(random_reqs):
        if not rejected[i]:
            continue
        num_accepted = len(outputs[r])
        if draft_probs is None:
            probs[i, draft_token_ids[r][num_accepted]] = 0.0
        else:
            probs[i] = (probs[i] - draft_probs[draft_starts[r] + num_accepted]).clamp_(min=0.0)
        if not bool(probs[i].sum() > 0):  # rounding left nothing: p itself (rejection was ~0)
            probs[i] = target_probs[final_rows[i]]
    # The race needs no normalisation: argmax(p / E) is scale-invariant.
    race_generators = {i: generators[r] for i, r in enumerate(random_reqs) if r in generators}
    final_tokens = random_sample(probs, race_generators).tolist()
    for r, token_id in zip(random_reqs, final_tokens, strict=True):
        outputs[r].append(token_id)
    return outputs
