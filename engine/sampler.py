"""Token sampling for one step's batch, in vLLM v1's order.

grammar mask -> raw logprobs -> min_tokens -> logit_bias -> penalties -> greedy argmax |
(temperature -> min_p -> top_k -> top_p -> exponential race). `SamplingMetadata.build` skips
every tensor no row needs, so an all-greedy batch without extras is one argmax.

The grammar mask (structured outputs) comes first, as vLLM applies it to the logits before
its sampler: logprobs are those of the model's distribution over the tokens the grammar
allows (the others at -inf), without logit_bias, penalties or temperature.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.outputs import LogprobsEntry
from engine.request import SamplingParams

_SAMPLING_EPS = 1e-5
_NUM_TOP_P_CANDIDATES = 1024


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for the B rows that sample this step (row i = params[i])."""

    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None  # [B] float32, 0.0 on greedy rows; None if all greedy
    top_p: torch.Tensor | None  # [B] float32, 1.0 = off; None if no row uses it
    top_k: torch.Tensor | None  # [B] int64, V = off; None if no row uses it
    min_p: torch.Tensor | None  # [B] float32, 0.0 = off; None if no row uses it
    generators: dict[int, torch.Generator]  # row -> its request's generator (seeded random rows)
    max_num_logprobs: int | None  # N = max top-N over rows; None if no row asks for logprobs
    # (rows [K] int64, token ids [K] int64): EOS / stop ids masked while below min_tokens.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None
    # (rows [K] int64, token ids [K] int64, biases [K] float32)
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # The five penalty fields are None unless some row has a penalty.
    presence_penalties: torch.Tensor | None  # [B] float32
    frequency_penalties: torch.Tensor | None  # [B] float32
    repetition_penalties: torch.Tensor | None  # [B] float32
    output_token_counts: torch.Tensor | None  # [B, V] float32, occurrences in the output
    seen_mask: torch.Tensor | None  # [B, V] bool, token in the prompt or the output
    # (rows [K] int64, allowed [K, V] bool): the rows with a grammar and the tokens it allows
    # there (structured outputs); None if no row has one
    grammar_mask: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        eos_token_ids: list[int | None],
        device: torch.device | str,
        grammar_mask: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplingMetadata:
        """Gather the batch's sampling inputs; `generators` maps row -> that row's generator;
        `grammar_mask` as the field is.

        Token lists are read, not kept: build once per step, after this step's inputs are known.
        """
        greedy = [p.is_greedy for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)

        def row_tensor(values: list[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        temperature = top_p = top_k = min_p = None
        if not all_greedy:
            temperature = row_tensor([p.temperature for p in params], torch.float32)
            if any(p.top_p < 1.0 for p in params):
                top_p = row_tensor([p.top_p for p in params], torch.float32)
            if any(0 < p.top_k < vocab_size for p in params):
                top_k = row_tensor(
                    [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
                    torch.int64,
                )
            if any(p.min_p > _SAMPLING_EPS for p in params):
                min_p = row_tensor([p.min_p for p in params], torch.float32)

        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            # A greedy row never draws, so its generator must not advance.
            generators={i: g for i, g in generators.items() if not greedy[i]},
            max_num_logprobs=max(logprobs) if logprobs else None,
            min_tokens_mask=_build_min_tokens_mask(
                params, output_token_ids, eos_token_ids, vocab_size, device
            ),
            logit_bias=_build_logit_bias(params, vocab_size, device),
            **_build_penalties(params, prompt_token_ids, output_token_ids, vocab_size, device),
            grammar_mask=grammar_mask,
        )


def _build_min_tokens_mask(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    eos_token_ids: list[int | None],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    cols: list[int] = []
    for i, p in enumerate(params):
        if len(output_token_ids[i]) >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos and eos_token_ids[i] is not None:
            stop_ids.add(eos_token_ids[i])
        stop_ids = [t for t in stop_ids if t < vocab_size]
        rows += [i] * len(stop_ids)
        cols += stop_ids
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(cols, dtype=torch.int64, device=device),
    )


def _build_logit_bias(
    params: list[SamplingParams], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    for i, p in enumerate(params):
        # Ids past the model's vocabulary cannot be sampled anyway.
        for token_id, bias in (p.logit_bias or {}).items():
            if token_id < vocab_size:
                rows.append(i)
                cols.append(token_id)
                biases.append(bias)
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(cols, dtype=torch.int64, device=device),
        torch.tensor(biases, dtype=torch.float32, device=device),
    )


def _build_penalties(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device | str,
) -> dict[str, torch.Tensor | None]:
    names = (
        "presence_penalties",
        "frequency_penalties",
        "repetition_penalties",
        "output_token_counts",
        "seen_mask",
    )
    if not any(p.has_penalties for p in params):
        return dict.fromkeys(names)
    output_counts = _token_counts(output_token_ids, vocab_size, device)
    seen = (output_counts > 0) | (_token_counts(prompt_token_ids, vocab_size, device) > 0)
    per_row = [(p.presence_penalty, p.frequency_penalty, p.repetition_penalty) for p in params]
    presence, frequency, repetition = torch.tensor(
        per_row, dtype=torch.float32, device=device
    ).unbind(1)
    return dict(zip(names, (presence, frequency, repetition, output_counts, seen), strict=True))


def _token_counts(
    token_ids: list[list[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """[B, V] float32 occurrence counts; rows are padded into an extra bin V that is dropped."""
    max_len = max((len(t) for t in token_ids), default=0)
    padded = torch.tensor(
        [t + [vocab_size] * (max_len - len(t)) for t in token_ids], dtype=torch.int64, device=device
    ).view(len(token_ids), max_len)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


@dataclass
class LogprobsTensors:
    """Logprobs for the B sampled tokens; column 0 is the sampled token, columns 1..N the top-N."""

    logprob_token_ids: torch.Tensor  # [B, N + 1] int64
    logprobs: torch.Tensor  # [B, N + 1] float32
    selected_token_ranks: torch.Tensor  # [B] int64, 1-based rank of the sampled token

    def to_entries(self, num_logprobs: list[int | None]) -> list[LogprobsEntry | None]:
        """Per-row entries, each cut to its request's own N (None where it asked for none)."""
        token_ids = self.logprob_token_ids.tolist()
        logprobs = self.logprobs.tolist()
        ranks = self.selected_token_ranks.tolist()
        return [
            None
            if n is None
            else LogprobsEntry(token_ids[i][: n + 1], logprobs[i][: n + 1], ranks[i])
            for i, n in enumerate(num_logprobs)
        ]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None


class Sampler(torch.nn.Module):
    """Samples one token per row from [B, V] logits; never modifies its input."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = apply_grammar_mask(logits, metadata)
        # Logprobs are reported from the raw distribution, before any processing (vLLM default).
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            if metadata.max_num_logprobs is not None
            else None
        )
        logits = self.process_logits(logits, metadata)
        sampled = self.sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """min_tokens mask, logit_bias, penalties: a new float32 tensor if any applies, else
        `logits` as given (greedy rows need no float32 copy: the argmax is the same)."""
        if (
            metadata.min_tokens_mask is None
            and metadata.logit_bias is None
            and metadata.repetition_penalties is None
        ):
            return logits
        given, logits = logits, logits.to(torch.float32, copy=True)
        if metadata.min_tokens_mask is not None:
            logits[metadata.min_tokens_mask] = float("-inf")
            if metadata.grammar_mask is not None:
                # A grammar whose text is complete allows only EOS: the text ends there, below
                # min_tokens (a row with every token at -inf could sample none).
                rows = metadata.grammar_mask[0]
                ended = rows[logits[rows].isneginf().all(dim=1)]
                logits[ended] = given[ended]
        if metadata.logit_bias is not None:
            rows, cols, biases = metadata.logit_bias
            logits.index_put_((rows, cols), biases, accumulate=True)
        if metadata.repetition_penalties is not None:
            logits = apply_penalties(logits, metadata)
        return logits

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """[B] int64: argmax on greedy rows, a filtered random draw on the others."""
        greedy = None if metadata.all_random else argmax_rows(logits)
        if metadata.all_greedy:
            return greedy
        sampled = random_sample(self.compute_probs(logits, metadata), metadata.generators)
        if greedy is None:
            return sampled
        return torch.where(metadata.temperature < _SAMPLING_EPS, greedy, sampled)

    @staticmethod
    def compute_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """[B, V] float32: the distribution random rows draw from (temperature, min_p, top_k,
        top_p applied to processed logits). Not all greedy; greedy rows get their softmax."""
        temperature = metadata.temperature
        if not metadata.all_random:
            # Greedy rows divide by 1 so the random branch stays finite; their argmax is kept.
            temperature = temperature.masked_fill(temperature < _SAMPLING_EPS, 1.0)
        logits = logits.float() / temperature.unsqueeze(1)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None:
            logits = apply_top_k(logits, metadata.top_k)
        if metadata.top_p is not None:
            logits = apply_top_p(logits, metadata.top_p)
        return logits.softmax(dim=-1)


def apply_grammar_mask(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """A float32 copy of the logits with the tokens each grammar row forbids at -inf, or
    `logits` itself (in its own dtype) when no row has a grammar."""
    if metadata.grammar_mask is None:
        return logits
    rows, allowed = metadata.grammar_mask
    masked = logits.to(torch.float32, copy=True)
    masked[rows] = masked[rows].where(allowed, float("-inf"))
    return masked


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """vLLM semantics: repetition on prompt+output tokens (positive logits divided, negative
    multiplied), then frequency (per occurrence) and presence (once) on output tokens."""
    rep = metadata.repetition_penalties.unsqueeze(1).expand_as(logits)
    rep = torch.where(metadata.seen_mask, rep, torch.ones_like(rep))
    # A penalty below float32's range is 0 here: a forbidden token's -inf times it is NaN
    # (it stays -inf) and a positive logit over it +inf (the largest float, so that the row
    # still has a finite maximum to sample from).
    logits = torch.where(logits > 0, logits / rep, logits * rep).nan_to_num(
        nan=float("-inf"), posinf=torch.finfo(torch.float32).max
    )
    counts = metadata.output_token_counts
    logits -= metadata.frequency_penalties.unsqueeze(1) * counts
    logits -= metadata.presence_penalties.unsqueeze(1) * (counts > 0)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k best tokens (ties at the k-th included); rows with k = V untouched.

    One `topk` of the largest k, not a sort: sorting a 49k vocabulary is ~40x slower on CPU.
    """
    no_top_k = top_k == logits.shape[1]
    k = top_k.masked_fill(no_top_k, 1)
    top_values = logits.topk(int(k.max()), dim=-1).values
    kth_largest = top_values.gather(1, (k - 1).unsqueeze(1))
    kth_largest.masked_fill_(no_top_k.unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of best tokens whose probability reaches top_p (at least
    the best token); rows with top_p = 1 untouched."""
    probs = logits.softmax(dim=-1)
    has_top_p = (top_p < 1.0).unsqueeze(1)
    # The nucleus nearly always lies among a few hundred best tokens: rank only those then.
    top_probs, top_idx = probs.topk(min(_NUM_TOP_P_CANDIDATES, logits.shape[1]), dim=-1)
    cum_probs = top_probs.cumsum(dim=-1)
    if not bool(((cum_probs[:, -1:] >= top_p.unsqueeze(1)) | ~has_top_p).all()):
        top_probs, top_idx = probs.sort(dim=-1, descending=True)
        cum_probs = top_probs.cumsum(dim=-1)
    # A token stays while the mass ranked above it is short of top_p; unranked ones go. The
    # best one always stays: a top_p below float32's range (5e-324, schemathesis) is 0 here,
    # which dropped every token, and a grammar then refused the token drawn (a 500).
    drop = (cum_probs - top_probs >= top_p.unsqueeze(1)) & has_top_p
    drop[:, 0] = False
    mask = has_top_p.expand_as(logits).scatter(1, top_idx, drop)
    return logits.masked_fill(mask, float("-inf"))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[B] int64: each row's first maximum, as `argmax(dim=-1)` gives it: on the CPU by the C
    kernel `cpu_ops.argmax_rows` (2 threads, 128 bf16 rows of 49,152: 1.1 ms, against 5.3 in
    torch's `max` and more in its `argmax`), elsewhere (or without a C compiler) by `max`."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and _cpu_kernels():
        from engine.kernels import cpu_ops

        return cpu_ops.argmax_rows(x if x.stride(-1) == 1 else x.contiguous())
    return x.max(dim=-1).indices


@functools.cache
def _cpu_kernels() -> bool:
    """kvrail's C kernels can be built here (a C compiler is present)."""
    from engine.kernels import cpu_build

    return cpu_build.compiler() is not None


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exponential race: argmax(p / q), q ~ Exp(1), is a draw from p. A seeded row draws its q
    from its own generator, so its tokens do not depend on what else is in the batch.

    q = -log(u), u ~ U[0, 1): the same Exp(1), but `exponential_` is ~5x slower on CPU.
    """
    u = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        u.uniform_()
    for i, generator in generators.items():
        u[i].uniform_(generator=generator)
    return argmax_rows(probs.div_(u.log_().neg_()))


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """The sampled token's logprob and 1-based rank, then the top-`num_logprobs` tokens."""
    token_ids = token_ids.unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(
        logprob_token_ids=torch.cat((token_ids, top_ids), dim=1),
        logprobs=torch.cat((token_logprobs, top_logprobs), dim=1),
        selected_token_ranks=ranks,
    )
