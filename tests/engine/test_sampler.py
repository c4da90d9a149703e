from __future__ import annotations

import math

import pytest
import torch

from engine.request import SamplingParams
from engine.sampler import Sampler, SamplingMetadata, apply_top_k, apply_top_p, argmax_rows

V = 32
EOS = 2


def make_metadata(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    seeds: dict[int, int] | None = None,
    vocab_size: int = V,
) -> SamplingMetadata:
    generators = {row: torch.Generator().manual_seed(seed) for row, seed in (seeds or {}).items()}
    return SamplingMetadata.build(
        params,
        prompt_token_ids=prompts or [[] for _ in params],
        output_token_ids=outputs or [[] for _ in params],
        generators=generators,
        vocab_size=vocab_size,
        eos_token_ids=[EOS] * len(params),
        device="cpu",
    )


def random_logits(batch: int, seed: int = 0, vocab_size: int = V) -> torch.Tensor:
    return torch.randn(batch, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def sample(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> torch.Tensor:
    return Sampler()(logits, make_metadata(params, **kwargs)).sampled_token_ids


def test_greedy_is_argmax_and_builds_nothing():
    logits = random_logits(8)
    params = [SamplingParams(temperature=0.0) for _ in range(8)]
    metadata = make_metadata(params)
    assert metadata.all_greedy and not metadata.all_random
    assert metadata.temperature is None and metadata.top_k is None
    assert metadata.repetition_penalties is None and metadata.min_tokens_mask is None
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


def test_greedy_rows_stay_greedy_in_a_random_batch():
    logits = random_logits(64, seed=3)
    params = [SamplingParams(temperature=0.0 if i % 2 else 2.0) for i in range(64)]
    sampled = sample(logits, params)
    argmax = logits.argmax(dim=-1)
    assert torch.equal(sampled[1::2], argmax[1::2])
    assert not torch.equal(sampled[::2], argmax[::2])


def test_sampler_does_not_modify_logits():
    logits = random_logits(4)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.7, top_k=3, top_p=0.5, min_p=0.1),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={3: 5.0}),
        SamplingParams(min_tokens=2, frequency_penalty=1.0),
        SamplingParams(temperature=1.0),
    ]
    sample(logits, params, outputs=[[1], [2], [3], []])
    assert torch.equal(logits, before)


def test_bf16_logits_sample_as_their_float32_values():
    """Logits come in the model's dtype; every processor and draw works on float32 copies, so
    bf16 logits give what their float32 values give, seeded draws and logprobs included."""
    logits = random_logits(6, seed=5).bfloat16()
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={3: 5.0}),
        SamplingParams(min_tokens=2, frequency_penalty=1.0, seed=1),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=2),
        SamplingParams(temperature=1.0, min_p=0.05, seed=3, logprobs=2),
        SamplingParams(temperature=0.0, presence_penalty=0.5, logprobs=1),
    ]
    kwargs = {"outputs": [[1], [2], [3], [4], [], [5, 5]], "seeds": {2: 1, 3: 2, 4: 3}}
    outs = [Sampler()(x, make_metadata(params, **kwargs)) for x in (logits, logits.float())]
    assert torch.equal(outs[0].sampled_token_ids, outs[1].sampled_token_ids)
    assert outs[0].logprobs is not None
    assert torch.equal(outs[0].logprobs.logprobs, outs[1].logprobs.logprobs)


@pytest.mark.parametrize("knob", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_extreme_filters_equal_greedy(knob):
    logits = random_logits(64, seed=1)
    params = [SamplingParams(temperature=1.5, **knob) for _ in range(64)]
    assert torch.equal(sample(logits, params), logits.argmax(dim=-1))


def test_top_k_keeps_only_the_k_best():
    logits = random_logits(1, seed=2).expand(4000, V).contiguous()
    top3 = set(logits[0].topk(3).indices.tolist())
    drawn = set(sample(logits, [SamplingParams(top_k=3)] * 4000).tolist())
    assert drawn == top3


def test_min_p_filters_low_probability_tokens():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4).contiguous()
    # min_p=0.2 keeps tokens with p >= 0.1: ids 0, 1, 2.
    drawn = sample(logits, [SamplingParams(min_p=0.2)] * 4000, vocab_size=4)
    assert set(drawn.tolist()) == {0, 1, 2}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4).contiguous()
    drawn = sample(logits, [SamplingParams(top_p=0.7)] * 4000, vocab_size=4)
    assert set(drawn.tolist()) == {0, 1}


def test_temperature_sampling_matches_softmax():
    torch.manual_seed(0)
    n, temperature = 40_000, 0.8
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    logits = base.expand(n, 8).contiguous()
    drawn = sample(logits, [SamplingParams(temperature=temperature)] * n, vocab_size=8)
    observed = torch.bincount(drawn, minlength=8).double()
    expected = (base / temperature).softmax(dim=-1).double() * n
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    # 7 degrees of freedom: P(chi2 > 30) < 1e-4 for a correct sampler.
    assert chi2 < 30, (observed, expected)


def test_seeded_rows_do_not_depend_on_the_batch():
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=7)
    seeded_logits = [random_logits(1, seed=s) for s in range(20)]  # one per step

    def run(batch: list[SamplingParams], row: int, seeds: dict[int, int]) -> list[int]:
        generators = {r: torch.Generator().manual_seed(s) for r, s in seeds.items()}
        tokens = []
        for step, row_logits in enumerate(seeded_logits):
            logits = random_logits(len(batch), seed=100 + step)
            logits[row] = row_logits[0]
            metadata = SamplingMetadata.build(
                batch, [[]] * len(batch), [[]] * len(batch), generators, V, [EOS] * 4, "cpu"
            )
            tokens.append(Sampler()(logits, metadata).sampled_token_ids[row].item())
        return tokens

    alone = run([seeded], 0, {0: 7})
    mixed = [
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0.0, seed=3),
        seeded,
        SamplingParams(temperature=1.2, seed=8),
    ]
    assert run(mixed, 2, {1: 3, 2: 7, 3: 8}) == alone
    assert run([seeded], 0, {0: 8}) != alone  # the seed matters
    assert len(set(alone)) > 3  # it really sampled


def test_unseeded_rows_vary():
    logits = random_logits(1).expand(200, V).contiguous()
    assert len(set(sample(logits, [SamplingParams()] * 200).tolist())) > 5


def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    params = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    # Prompt has token 0 and 1; the output has token 2 twice and token 3 once.
    metadata = make_metadata([params], prompts=[[0, 1]], outputs=[[2, 3, 2]], vocab_size=6)
    out = Sampler.process_logits(logits, metadata)
    expected = torch.tensor(
        [
            [
                2.0 / 2,  # prompt token, positive: divided
                -2.0 * 2,  # prompt token, negative: multiplied
                1.0 / 2 - 0.5 * 2 - 0.25,  # output token twice
                -1.0 * 2 - 0.5 * 1 - 0.25,  # output token once
                0.5,  # unseen
                3.0,  # unseen
            ]
        ]
    )
    torch.testing.assert_close(out, expected)


def test_penalties_only_on_rows_that_ask():
    logits = random_logits(2, vocab_size=6)
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams()]
    metadata = make_metadata(params, prompts=[[0, 1], [0, 1]], outputs=[[2], [2]], vocab_size=6)
    out = Sampler.process_logits(logits, metadata)
    assert torch.equal(out[1], logits[1])
    assert not torch.equal(out[0, :3], logits[0, :3]) and torch.equal(out[0, 3:], logits[0, 3:])


def test_a_penalty_that_underflows_float32_keeps_forbidden_tokens_out():
    # 1e-300 is 0 in float32: forbidden (-inf) tokens times it were NaN, which argmax and the
    # random draw picked; a grammar then refused the token (an engine error, a 500).
    logits = random_logits(2)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1e-300),
        SamplingParams(temperature=1.0, repetition_penalty=1e-300),
    ]
    allowed = torch.zeros(2, V, dtype=torch.bool)
    allowed[:, [4, 7]] = True
    grammar_mask = (torch.tensor([0, 1]), allowed)
    metadata = SamplingMetadata.build(
        params,
        prompt_token_ids=[list(range(V))] * 2,
        output_token_ids=[[], []],
        generators={1: torch.Generator().manual_seed(0)},
        vocab_size=V,
        eos_token_ids=[EOS] * 2,
        device="cpu",
        grammar_mask=grammar_mask,
    )
    for _ in range(20):
        assert set(Sampler()(logits, metadata).sampled_token_ids.tolist()) <= {4, 7}
    processed = Sampler.process_logits(logits, metadata)
    assert not processed.isnan().any()


def test_a_top_p_that_underflows_float32_keeps_the_best_allowed_token():
    # 5e-324 is 0 in float32: every token was dropped, the draw took token 0, and a grammar
    # refused it (an engine error, a 500). The best token, of those allowed, is kept.
    logits = random_logits(2)
    params = [SamplingParams(temperature=1.0, top_p=5e-324) for _ in range(2)]
    allowed = torch.zeros(2, V, dtype=torch.bool)
    allowed[:, [4, 7]] = True
    metadata = SamplingMetadata.build(
        params,
        prompt_token_ids=[[1], [1]],
        output_token_ids=[[], []],
        generators={i: torch.Generator().manual_seed(i) for i in range(2)},
        vocab_size=V,
        eos_token_ids=[EOS] * 2,
        device="cpu",
        grammar_mask=(torch.tensor([0, 1]), allowed),
    )
    best = torch.where(allowed, logits, float("-inf")).argmax(dim=-1)
    for _ in range(10):
        assert torch.equal(Sampler()(logits, metadata).sampled_token_ids, best)


def test_logit_bias_forces_a_token():
    logits = random_logits(16)
    params = [SamplingParams(temperature=1.0, logit_bias={5: 100.0}) for _ in range(8)]
    params += [SamplingParams(temperature=0.0, logit_bias={9: 100.0}) for _ in range(8)]
    assert sample(logits, params).tolist() == [5] * 8 + [9] * 8


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, V)
    logits[:, EOS] = 50.0
    logits[:, 7] = 40.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),
    ]
    # Row 1 already has 3 output tokens, so nothing is masked any more.
    outputs = [[4, 4], [4, 4, 4], [4], [4]]
    assert sample(logits, params, outputs=outputs).tolist() == [
        _best_excluding(logits[0], {EOS, 7}),
        EOS,
        7,
        EOS,
    ]


def _best_excluding(row: torch.Tensor, banned: set[int]) -> int:
    row = row.clone()
    row[list(banned)] = -math.inf
    return int(row.argmax())


def test_logprobs_columns_and_ranks():
    logits = random_logits(3, seed=5)
    logit_bias = {int(logits[0].argsort()[-4]): 100.0}  # force row 0 to its 4th-best token
    params = [
        SamplingParams(temperature=0.0, logprobs=3, logit_bias=logit_bias),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler()(logits, make_metadata(params))
    raw = logits.log_softmax(dim=-1)
    lp = out.logprobs
    assert lp.logprob_token_ids.shape == (3, 4) and lp.logprobs.shape == (3, 4)
    assert torch.equal(lp.logprob_token_ids[:, 0], out.sampled_token_ids)
    # Logprobs are those of the raw logits, even where the bias changed the choice.
    torch.testing.assert_close(
        lp.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0]
    )
    top = raw.topk(3, dim=-1)
    assert torch.equal(lp.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    assert lp.selected_token_ranks.tolist() == [4, 1, 1]

    entries = lp.to_entries([p.logprobs for p in params])
    assert entries[2] is None
    assert len(entries[0].token_ids) == 4 and entries[0].sampled_token_rank == 4
    assert entries[1].token_ids == [out.sampled_token_ids[1].item()]


@pytest.mark.parametrize("scale", [0.1, 3.0])  # flat: nucleus wider than the candidate set
def test_top_p_and_top_k_masks_match_a_reference(scale):
    vocab_size = 4096
    logits = random_logits(6, seed=9, vocab_size=vocab_size) * scale
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.99, 1.0, 0.3])
    top_k = torch.tensor([vocab_size, 7, vocab_size, 100, vocab_size, 1])
    out = apply_top_p(apply_top_k(logits, top_k), top_p)
    for row in range(6):
        ranked = logits[row].sort(descending=True)
        kept = ranked.indices[: int(top_k[row])]
        probs = logits[row, kept].softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        kept = kept[mass_above < top_p[row]] if top_p[row] < 1 else kept
        assert set(out[row].isfinite().nonzero().flatten().tolist()) == set(kept.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_argmax_on_ties_and_infinities(dtype):
    """Greedy tokens come from `argmax_rows` (a C kernel on the CPU): it must pick the same
    index as `argmax` everywhere, the first of tied maxima included, in rows of one chunk of
    the kernel or many."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (64, 300), generator=gen).to(dtype)  # many ties per row
    x[1] = float("-inf")
    x[2, 10:] = float("-inf")
    x[3] = 0.0
    x[4, 299] = float("inf")
    x[5] = -1.0
    x[5, 70], x[5, 200] = -0.0, 0.0  # equal maxima: the first
    x[6] = torch.randn(300, generator=gen).to(dtype) - 1e4
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    wide = torch.randn(3, 49_152, generator=gen).to(dtype)
    wide[1, 40_000] = 100.0
    assert torch.equal(argmax_rows(wide), wide.argmax(dim=-1))
