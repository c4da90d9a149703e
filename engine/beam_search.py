"""Beam search: vLLM's `LLM.beam_search` interface, HF transformers' scoring and stopping, and
beams that share their KV blocks.

vLLM v1 runs beam search above its engine, and so does kvrail: each live beam is one engine
request computing one token, whose top 2k logprobs (k = `beam_width`; the sampler's raw
logprobs, a log-softmax over the whole vocabulary in fp32) are the beam's candidates. When
every beam of a step has reported, `BeamSearch.step` forms the next beams, and each is
forked from the request of the beam it continues (`Scheduler.fork_request`): it shares that
request's KV blocks by reference count instead of recomputing its prefix. The parent's partly
filled last block is shared too, until a sharer writes into it: the first writers get a copy
(copy on write, `KVCacheManager.allocate_slots`; the model runner copies the block before the
step's forward), the last one writes in place. A beam's request finishes after its one token
but keeps its blocks (`Request.keep_blocks`) until its step's beams are forked, then releases
them (`Scheduler.release_blocks`).

Scoring and stopping are those of transformers' `_beam_search` (5.x), so the sequences are
those of `generate(do_sample=False, num_beams=k, length_penalty=lp, early_stopping=False,
max_new_tokens=max_tokens)` (HF's default `early_stopping`), best first:
- each step ranks all (beam, token) candidates by cumulative logprob and keeps the best 2k;
- a kept candidate ending in EOS (unless `ignore_eos`), or reaching `max_tokens`, is a
  finished hypothesis when it ranks among the first k, scored
  `cum_logprob / num_generated ** length_penalty` (the EOS counted); the k best are kept;
- the first k other candidates are the next beams;
- the search ends at `max_tokens`, or once k hypotheses are kept and the best beam, scored at
  its current length, does not beat the worst of them (HF's heuristic for
  `early_stopping=False`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, EngineCoreOutput, RequestOutput
from engine.request import MAX_INT32, MAX_LOGPROBS, FinishReason, Request, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.engine_core import EngineCore

# A beam's candidates are its request's top 2k logprobs, at most MAX_LOGPROBS (as in vLLM,
# whose beam search asks for 2k logprobs within its max_logprobs, 20 by default).
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
# |length_penalty| at most this: a larger exponent only makes the longest (or the shortest)
# hypothesis win, and `len ** length_penalty` must stay a finite, non-zero float (8192 ** 10 is
# 2 ** 130; 2 ** 1e308 raises OverflowError, which would fail the engine's step).
MAX_ABS_LENGTH_PENALTY = 10.0


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams`: `beam_width` beams, at most `max_tokens` new tokens each
    (None: up to max_model_len), EOS an ordinary token with `ignore_eos`, and HF's
    `length_penalty` exponent on the generated length. Validated on construction: a bad value
    raises `ValueError` naming the field."""

    beam_width: int
    max_tokens: int | None
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        check(
            is_int(self.beam_width) and 1 <= self.beam_width <= MAX_BEAM_WIDTH,
            "beam_width",
            f"must be an integer in [1, {MAX_BEAM_WIDTH}]",
        )
        check(
            self.max_tokens is None
            or (is_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_INT32),
            "max_tokens",
            f"must be None or an integer in [1, {MAX_INT32}]",
        )
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        check(
            isinstance(self.length_penalty, int | float)
            and not isinstance(self.length_penalty, bool)
            and abs(self.length_penalty) <= MAX_ABS_LENGTH_PENALTY,
            "length_penalty",
            f"must be a number in [-{MAX_ABS_LENGTH_PENALTY}, {MAX_ABS_LENGTH_PENALTY}]",
        )


@dataclass
class BeamSearchSequence:
    """One of a prompt's `beam_width` results, as vLLM's: `tokens` are the prompt's and the
    generated ones (EOS included when it ended the sequence), `text` their decode."""

    tokens: list[int]
    cum_logprob: float
    text: str
    finish_reason: FinishReason


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class Beam:
    token_ids: list[int]  # generated so far
    cum_logprob: float
    score: float = 0.0  # a finished hypothesis's: cum_logprob / len(token_ids) ** length_penalty


@dataclass
class BeamSearch:
    """One prompt's search, as HF's (see the module docstring): the running beams, all of one
    length, and the best finished hypotheses."""

    params: BeamSearchParams
    eos_token_id: int | None  # None with ignore_eos
    max_new_tokens: int
    beams: list[Beam] = field(default_factory=lambda: [Beam([], 0.0)])
    finished: list[Beam] = field(default_factory=list)  # best first, at most beam_width
    is_done: bool = False

    def step(self, top: list[list[tuple[int, float]]]) -> list[int]:
        """Extend the search by one token from each beam's top 2k (token id, logprob).
        Returns, for each of the next beams (now `beams`), the index of the beam it continues;
        none once the search is done."""
        k, length_penalty = self.params.beam_width, self.params.length_penalty
        num_generated = len(self.beams[0].token_ids) + 1
        candidates = sorted(
            (
                (beam.cum_logprob + logprob, i, token_id)
                for i, beam in enumerate(self.beams)
                for token_id, logprob in top[i]
            ),
            key=lambda candidate: -candidate[0],
        )[: 2 * k]
        at_max_tokens = num_generated >= self.max_new_tokens
        beams, parents = [], []
        for rank, (cum_logprob, i, token_id) in enumerate(candidates):
            beam = Beam([*self.beams[i].token_ids, token_id], cum_logprob)
            if at_max_tokens or token_id == self.eos_token_id:
                if rank < k:  # the others are only there to leave k beams running
                    beam.score = cum_logprob / num_generated**length_penalty
                    self.finished.append(beam)
            elif len(beams) < k:
                beams.append(beam)
                parents.append(i)
        self.finished = sorted(self.finished, key=lambda beam: -beam.score)[:k]
        self.beams = beams
        self.is_done = not beams or (
            len(self.finished) == k
            and beams[0].cum_logprob / num_generated**length_penalty <= self.finished[-1].score
        )
        return [] if self.is_done else parents


class BeamSearchRequest:
    """A prompt's beam search on an `EngineCore`: one engine request per running beam
    (`request_ids`), each forked from the request of the beam it continues. The engine routes
    its requests' outputs by `child_to_parent`, kept up to date here."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        engine_core: EngineCore,
        child_to_parent: dict[str, str],
        eos_token_id: int | None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.engine_core = engine_core
        self.child_to_parent = child_to_parent
        self.eos_token_id = eos_token_id
        self.priority = priority
        # At least one token, as a `SamplingParams` request gets when its prompt fills the model.
        room = max(1, engine_core.max_model_len - len(prompt_token_ids))
        self.search = BeamSearch(
            params,
            None if params.ignore_eos else eos_token_id,
            min(params.max_tokens or room, room),
        )
        self.sampling_params = SamplingParams(
            temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width
        )
        self.num_steps = 0
        self.num_cached_tokens = 0  # of the prompt, found by the first request
        self.top: dict[str, list[tuple[int, float]]] = {}  # request id -> its beam's candidates
        first = self._request(0, [])
        engine_core.add_request(first)
        self.request_ids = [first.request_id]  # per running beam, the request computing it
        child_to_parent[first.request_id] = request_id

    def _request(self, index: int, token_ids: list[int]) -> Request:
        # With spaces, which no request id from the wire has (`queueing.schema`): a request
        # added meanwhile cannot take the id of a beam forked later.
        return Request(
            f"beam {self.num_steps}.{index} {self.request_id}",
            self.prompt_token_ids + token_ids,
            self.sampling_params,
            self.eos_token_id,
            priority=self.priority,
            keep_blocks=True,
        )

    def update(self, out: EngineCoreOutput) -> bool:
        """Take a beam's candidates from its request's output; once every beam has reported,
        fork the next beams from their parents' requests and release those. Returns whether
        the search has ended."""
        entry = out.new_logprobs[0]  # the sampled (greedy) token, then the top 2k
        self.top[out.request_id] = list(zip(entry.token_ids[1:], entry.logprobs[1:], strict=True))
        if self.num_steps == 0:
            self.num_cached_tokens = out.num_cached_tokens
        if len(self.top) < len(self.request_ids):
            return False
        parents = self.search.step([self.top[r] for r in self.request_ids])
        self.num_steps += 1
        children = [self._request(j, self.search.beams[j].token_ids) for j in range(len(parents))]
        for parent, child in zip(parents, children, strict=True):
            self.engine_core.fork_request(self.request_ids[parent], child)
            self.child_to_parent[child.request_id] = self.request_id
        self._release()
        self.request_ids, self.top = [child.request_id for child in children], {}
        return self.search.is_done

    def abort(self) -> None:
        """End the search now: its requests aborted, the blocks they kept freed."""
        self.engine_core.abort_requests(self.request_ids)
        self._release()
        self.request_ids = []

    def _release(self) -> None:
        self.engine_core.release_blocks(self.request_ids)
        for request_id in self.request_ids:
            del self.child_to_parent[request_id]

    def output(self, tokenizer: PreTrainedTokenizerBase) -> RequestOutput:
        """The finished search: its `beam_width` best hypotheses, best first, each a
        completion with its text (EOS left out, as a request's) and cumulative logprob."""
        completions = []
        for index, beam in enumerate(self.search.finished):
            ended_by_eos = beam.token_ids[-1] == self.search.eos_token_id
            detokenizer = IncrementalDetokenizer(
                tokenizer, self.prompt_token_ids, self.sampling_params
            )
            detokenizer.update(beam.token_ids, stop_terminated=ended_by_eos)
            completions.append(
                CompletionOutput(
                    index,
                    detokenizer.output_text,
                    beam.token_ids,
                    cumulative_logprob=beam.cum_logprob,
                    finish_reason=FinishReason.STOP if ended_by_eos else FinishReason.LENGTH,
                )
            )
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            completions,
            finished=True,
            num_cached_tokens=self.num_cached_tokens,
        )
