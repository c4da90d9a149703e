"""The user-facing engine: prompts in, `RequestOutput`s out (vLLM's `LLMEngine` and `LLM`).

`LLMEngine` tokenizes, fans a request with `n > 1` out into `n` child requests that share
the prompt's KV blocks through the prefix cache, runs `EngineCore` steps, and turns token
outputs into text with incremental detokenization and stop strings. A request with
`BeamSearchParams` is a beam search (`engine/beam_search.py`), answered once it ends.

A streaming-input session (`add_request(resumable=True)`) is one request fed in turns: when a
turn ends, its history (prompts and outputs so far, as delivered) is kept here and its KV in
the scheduler, and the next `add_request` with the same id is a request over the history plus
its new prompt, which takes that KV over. So a turn generates what a fresh request over the
whole history would (its detokenizer is primed from the history, `max_tokens` counts its own
output), without recomputing the history: the prefix cache would reuse only its full blocks,
and only those of a history re-sent token for token.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from engine.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchRequest,
    BeamSearchSequence,
)
from engine.calibration import calibration_token_ids
from engine.chat_template import apply_chat_template
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_core import EngineCore
from engine.loader import load_tokenizer, resolve_model
from engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    EngineStats,
    Logprob,
    LogprobsEntry,
    RequestOutput,
    UnfinishedRequest,
)
from engine.request import FinishReason, Request, SamplingParams, check_prompt_len

logger = logging.getLogger("kvrail.engine")

PromptType = str | list[int] | dict[str, Any]


@dataclass
class ChildState:
    """One completion of a request: its detokenizer and what was produced so far."""

    index: int
    detokenizer: IncrementalDetokenizer
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    resumed_token_ids: list[int] = field(default_factory=list)  # emitted before a resume


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, ChildState]  # child request id -> state
    num_cached_tokens: int = 0
    resumable: bool = False  # a session's turn: when it ends, the session waits for the next

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class LLMEngine:
    """Request-level engine. Not thread-safe: one thread drives `step()` (`tokenize_prompt`
    may run on any other)."""

    def __init__(self, config: EngineConfig) -> None:
        start = time.perf_counter()
        self.config = config
        model_dir = resolve_model(config.model)
        self.tokenizer = load_tokenizer(model_dir)
        self.engine_core = EngineCore(
            config, model_dir, self.tokenizer, calibration_token_ids(self.tokenizer)
        )
        self.max_model_len = self.engine_core.max_model_len
        self.vocab_size = self.engine_core.vocab_size
        # No token covers more characters of text than its longest token string has, so a
        # prompt longer than this cannot fit in max_model_len tokens: it is refused without
        # tokenizing (issue 12: two 1M-character prompts, tokenized on the engine thread,
        # stretched every other request's inter-token gap from 0.1 s to 2.4 s).
        token_strs = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        self.max_prompt_chars = self.max_model_len * max(len(t) for t in token_strs if t)
        self.parents: dict[str, ParentState] = {}
        self.beam_searches: dict[str, BeamSearchRequest] = {}
        self.child_to_parent: dict[str, str] = {}  # engine request id -> request id
        # Sessions waiting for their next turn: request id -> the token ids of every turn so
        # far (prompts and outputs as delivered), which the next turn's prompt follows
        self.sessions: dict[str, list[int]] = {}
        logger.info("engine ready in %.1f s", time.perf_counter() - start)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The text (None when given as ids) and token ids of a prompt the engine can take:
        not empty, at most `max_model_len` tokens, ids in the vocabulary; `ValueError` if not.

        A prompt is text, token ids, or {"prompt": ...} / {"prompt_token_ids": [...]}; a dict
        with both is a prompt tokenized elsewhere, its text kept for `RequestOutput.prompt`.
        It reads only the tokenizer and fixed limits, so it may run on any thread: a server
        tokenizes here, off the thread that steps, then adds the dict with both.
        """
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, prompt = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if len(prompt) > self.max_prompt_chars:
                raise ValueError(
                    f"prompt has {len(prompt)} characters, more than max_model_len "
                    f"{self.max_model_len} tokens can hold ({self.max_prompt_chars})"
                )
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            text = prompt
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        # Before the ids are checked one by one: a prompt refused for its length costs no
        # more than max_model_len checks (a 300,000-character one had 166,000 tokens).
        check_prompt_len(len(token_ids), self.max_model_len)
        if not isinstance(prompt, str):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise ValueError("prompt must be a string or a list of token ids")
            if any(not 0 <= t < self.vocab_size for t in token_ids):
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        return text, token_ids

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams,
        resume: Sequence[Sequence[int] | None] | None = None,
        priority: int = 0,
        resumable: bool = False,
    ) -> None:
        """Validate and queue a request; with `n > 1`, its children share the prompt's KV.
        With `BeamSearchParams`, a beam search: its `beam_width` choices come in one final
        output, best first.

        `priority` (vLLM's): with `scheduling_policy="priority"`, lower values run first and
        are preempted last, ties by arrival; under "fcfs" only 0 is taken, as in vLLM.

        `resumable` opens a session, or keeps it open: when this turn ends (its completion's
        `finish_reason` set, `RequestOutput.finished` False) the request keeps its KV and
        waits; `add_request` with the same id then appends `prompt` after everything so far
        and continues with `params` (`resumable=False` closes the session when that turn
        ends). A session continues one sequence: `n` must be 1, and a turn is not resumed.
        An unknown id starts a new request; an id that is running is a `ValueError`.

        `resume` continues a request whose earlier output was delivered elsewhere (a worker
        died): per choice index, the tokens already emitted (recomputed, never emitted
        again), or None for a choice that already finished. With `structured_outputs` they
        must follow the grammar (its matcher accepts them first), else `ValueError`, or, if
        the grammar still has to compile, the request ends with that `error`.

        Prompt logprobs are computed once, by choice 0 (the others take its prompt blocks
        from the prefix cache), and travel with its first token: a resumed request computes
        them again only when choice 0 had emitted nothing, i.e. they were never delivered.
        """
        if request_id in self.parents or request_id in self.beam_searches:
            raise ValueError(f"request_id {request_id!r} is already running")
        if not isinstance(resumable, bool):
            raise ValueError(f"resumable must be a boolean, got {resumable!r}")
        is_beam_search = isinstance(params, BeamSearchParams)
        if resumable and is_beam_search:
            raise ValueError("resumable: a beam search cannot be a session's turn")
        if resumable and params.n != 1:
            raise ValueError(
                f"resumable takes n=1 (a session continues one sequence), got {params.n}"
            )
        history = self.sessions.get(request_id)
        if history is not None and (resume is not None or is_beam_search):
            raise ValueError(
                f"request_id {request_id!r} is a session waiting for its next turn, which "
                "continues it by sampling: resume is for a request whose earlier output went "
                "elsewhere, and a beam search starts anew"
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"got priority {priority} but priority scheduling is not enabled "
                "(scheduling_policy='priority')"
            )
        prompt_text, prompt_token_ids = self.tokenize_prompt(prompt)
        if is_beam_search:
            if resume is not None and any(emitted != [] for emitted in resume):
                # Its choices are emitted only when it ends: nothing to resume from.
                raise ValueError("resume: a beam search can only restart (nothing emitted)")
            self.beam_searches[request_id] = BeamSearchRequest(
                request_id,
                prompt_text,
                prompt_token_ids,
                params,
                self.engine_core,
                self.child_to_parent,
                self.tokenizer.eos_token_id,
                priority,
            )
            return
        if history is not None:
            prompt_token_ids = history + prompt_token_ids
            check_prompt_len(len(prompt_token_ids), self.max_model_len)
        if resume is not None and len(resume) != params.n:
            raise ValueError(f"resume needs one entry per choice ({params.n})")
        if resume is not None:
            # Resumed tokens come from a response stream anyone can write to: an id outside
            # the vocabulary would fail the whole batch's step, not just this request.
            resumed = [t for emitted in resume if emitted for t in emitted]
            if any(not 0 <= t < self.vocab_size for t in resumed):
                raise ValueError(f"resumed token ids must be in [0, {self.vocab_size})")
        children = {}
        for index in range(params.n):
            emitted = [] if resume is None else resume[index]
            if emitted is None:
                continue
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            child_params = copy.copy(params)
            child_params.n = 1
            if params.seed is not None:  # in [0, 2^64): the generator reads a negative as that
                child_params.seed = (params.seed + index) % 2**64
            if emitted and child_params.max_tokens is not None:
                child_params.max_tokens = max(1, child_params.max_tokens - len(emitted))
            if index > 0 or emitted:
                child_params.prompt_logprobs = None
            children[child_id] = ChildState(
                index=index,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, child_params, list(emitted)
                ),
                params=child_params,
                resumed_token_ids=list(emitted),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
        if not children:
            raise ValueError("every choice of the resumed request has finished")
        added = []
        try:
            for child_id, child in children.items():
                self.engine_core.add_request(
                    Request(
                        child_id,
                        prompt_token_ids + child.resumed_token_ids,
                        child.params,
                        self.tokenizer.eos_token_id,
                        num_resumed_tokens=len(child.resumed_token_ids),
                        priority=priority,
                        resumable=resumable,
                    )
                )
                added.append(child_id)
        except Exception:
            self.engine_core.abort_requests(added)
            raise
        self.sessions.pop(request_id, None)
        self.parents[request_id] = ParentState(
            request_id, prompt_text, prompt_token_ids, children, resumable=resumable
        )
        for child_id in children:
            self.child_to_parent[child_id] = request_id

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests (by the id given to `add_request`), or close waiting sessions;
        their KV is freed now."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            search = self.beam_searches.pop(request_id, None)
            if search is not None:
                search.abort()
            if self.sessions.pop(request_id, None) is not None:
                self.engine_core.abort_requests([request_id])
                continue
            parent = self.parents.pop(request_id, None)
            if parent is None:
                continue
            self.engine_core.abort_requests(list(parent.children))
            for child_id in parent.children:
                del self.child_to_parent[child_id]

    def abort_all(self) -> list[str]:
        """Abort every unfinished request and close every waiting session; returns their ids."""
        request_ids = [*self.parents, *self.beam_searches, *self.sessions]
        self.abort_request(request_ids)
        return request_ids

    def get_session_token_ids(self, request_id: str) -> list[int] | None:
        """The token ids of every turn so far of a session waiting for its next turn (what
        that turn's prompt follows); None if `request_id` is not one."""
        return self.sessions.get(request_id)

    def get_unfinished_request(self, request_id: str) -> UnfinishedRequest | None:
        """The request's prompt length and its choices still generating; None once it has
        finished (its final `RequestOutput` was returned by `step`) or if it is unknown."""
        search = self.beam_searches.get(request_id)
        if search is not None:
            num_beams = search.search.params.beam_width
            return UnfinishedRequest(
                request_id, len(search.prompt_token_ids), list(range(num_beams))
            )
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        open_indices = [c.index for c in parent.children.values() if c.finish_reason is None]
        return UnfinishedRequest(request_id, len(parent.prompt_token_ids), open_indices)

    def step(self) -> list[RequestOutput]:
        """One engine step. Returns, per request that progressed, the new text and tokens.

        A request whose choice failed the step alone (`EngineCore.step`) ends with its
        `error`, its other choices aborted; the rest of the batch goes on. An exception
        raised here is one the core could not undo.
        """
        outputs = [
            RequestOutput(request_id, None, self.sessions.pop(request_id), [], finished=True)
            for request_id in self.engine_core.close_idle_sessions()
            if request_id in self.sessions
        ]
        deltas: dict[str, list[CompletionOutput]] = {}
        prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] = {}
        stops: dict[str, str] = {}
        errors: dict[str, str] = {}
        for out in self.engine_core.step():
            parent_id = self.child_to_parent.get(out.request_id)
            if parent_id is None:
                continue
            if out.error is not None:
                errors[parent_id] = out.error
                continue
            search = self.beam_searches.get(parent_id)
            if search is not None:
                if search.update(out):
                    del self.beam_searches[parent_id]
                    outputs.append(search.output(self.tokenizer))
                continue
            parent = self.parents[parent_id]
            delta = self._process_output(parent, out, stops)
            deltas.setdefault(parent_id, []).append(delta)
            if out.prompt_logprobs is not None:
                prompt_logprobs[parent_id] = [None] + [
                    self._to_logprob_dict(entry) for entry in out.prompt_logprobs
                ]
        if stops:
            self.engine_core.finish_requests_by_stop_string(stops)
        for parent_id, error in errors.items():
            parent = self.parents.get(parent_id) or self.beam_searches[parent_id]
            self.abort_request(parent_id)
            outputs.append(
                RequestOutput(
                    parent_id,
                    parent.prompt,
                    parent.prompt_token_ids,
                    [],
                    finished=True,
                    num_cached_tokens=parent.num_cached_tokens,
                    error=error,
                )
            )
        for parent_id, completions in deltas.items():
            if parent_id in errors:
                continue
            parent = self.parents[parent_id]
            finished = parent.finished
            outputs.append(
                RequestOutput(
                    request_id=parent_id,
                    prompt=parent.prompt,
                    prompt_token_ids=parent.prompt_token_ids,
                    outputs=completions,
                    finished=finished and not parent.resumable,
                    num_cached_tokens=parent.num_cached_tokens,
                    prompt_logprobs=prompt_logprobs.get(parent_id),
                )
            )
            if finished:
                del self.parents[parent_id]
                for child_id in parent.children:
                    del self.child_to_parent[child_id]
                if parent.resumable:  # one child: n is 1
                    [child] = parent.children.values()
                    history = parent.prompt_token_ids + child.resumed_token_ids + child.token_ids
                    self.sessions[parent_id] = history
        return outputs

    def _process_output(
        self, parent: ParentState, out: EngineCoreOutput, stops: dict[str, str]
    ) -> CompletionOutput:
        child = parent.children[out.request_id]
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        new_token_ids, new_entries = out.new_token_ids, out.new_logprobs
        num_decoded = len(child.detokenizer.output_token_ids)
        stop_string = child.detokenizer.update(new_token_ids)
        if stop_string is not None:
            if finish_reason is None:
                stops[out.request_id] = stop_string
            finish_reason, stop_reason = FinishReason.STOP, stop_string
            # Several tokens of a step (accepted drafts): those after the stop are dropped.
            num_kept = len(child.detokenizer.output_token_ids) - num_decoded
            new_token_ids, new_entries = new_token_ids[:num_kept], new_entries[:num_kept]
        child.token_ids.extend(new_token_ids)
        new_logprobs = [self._to_logprob_dict(entry) for entry in new_entries]
        if child.logprobs is not None:
            child.logprobs.extend(new_logprobs)
            child.cumulative_logprob += sum(entry.logprobs[0] for entry in new_entries)
        child.finish_reason, child.stop_reason = finish_reason, stop_reason
        return CompletionOutput(
            index=child.index,
            text=child.detokenizer.get_next_output_text(finish_reason is not None, delta=True),
            token_ids=list(new_token_ids),
            cumulative_logprob=child.cumulative_logprob,
            logprobs=new_logprobs if child.logprobs is not None else None,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )

    def _to_logprob_dict(self, entry: LogprobsEntry) -> dict[int, Logprob]:
        """Column 0 (the sampled or prompt token) with its rank, then the top-N ranked 1..N;
        a token in both keeps its first entry."""
        result: dict[int, Logprob] = {}
        decode = self.tokenizer.convert_ids_to_tokens
        for i, (token_id, logprob) in enumerate(zip(entry.token_ids, entry.logprobs, strict=True)):
            rank = entry.sampled_token_rank if i == 0 else i
            if token_id not in result:
                result[token_id] = Logprob(logprob, rank, decode(token_id))
        return result

    def has_unfinished_requests(self) -> bool:
        """Whether a request is running or waiting to run (a session waiting for its next
        turn is not: it needs no step)."""
        return bool(self.parents or self.beam_searches)

    def get_stats(self) -> EngineStats:
        return self.engine_core.get_stats()


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, token ids or a dict) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (prompts and all(isinstance(t, int) for t in prompts)):
        return [prompts]
    return list(prompts)


def merge_delta(acc: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold a step's delta into the running total of one request."""
    if acc is None:
        acc = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, [], False)
    by_index = {c.index: c for c in acc.outputs}
    for d in delta.outputs:
        c = by_index.get(d.index)
        if c is None:
            c = by_index[d.index] = CompletionOutput(
                d.index, "", [], logprobs=[] if d.logprobs is not None else None
            )
        c.text += d.text
        c.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            c.logprobs.extend(d.logprobs)
        c.cumulative_logprob = d.cumulative_logprob
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
    acc.outputs = sorted(by_index.values(), key=lambda c: c.index)
    acc.finished = delta.finished
    acc.num_cached_tokens = delta.num_cached_tokens
    acc.error = delta.error
    if delta.prompt_logprobs is not None:
        acc.prompt_logprobs = delta.prompt_logprobs
    return acc


class LLM:
    """Offline batch generation with vLLM's interface: `LLM(model).generate(prompts, params)`."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine.from_kwargs(model=model, **kwargs)
        self._next_request_id = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for all prompts; returns them in the order given.
        `priority`: one per prompt (`LLMEngine.add_request`'s), None = all 0."""
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts"
            )
        if priority is None:
            priority = [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        return self._run_engine(self._add_requests(prompts, sampling_params, priority), use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: one `BeamSearchOutput` per prompt, in the order given,
        with `params.beam_width` sequences best first (see `engine/beam_search.py`). As in
        vLLM, a sequence's `tokens` and `text` include the prompt."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompts = _prompt_list(prompts)
        request_ids = self._add_requests(prompts, [params] * len(prompts), [0] * len(prompts))
        decode = self.llm_engine.tokenizer.decode
        results = []
        for output in self._run_engine(request_ids, use_tqdm):
            sequences = []
            for completion in output.outputs:
                tokens = output.prompt_token_ids + completion.token_ids
                sequences.append(
                    BeamSearchSequence(
                        tokens,
                        completion.cumulative_logprob,
                        decode(tokens),
                        completion.finish_reason,
                    )
                )
            results.append(BeamSearchOutput(sequences))
        return results

    def _add_requests(
        self,
        prompts: list[PromptType],
        params: Sequence[SamplingParams | BeamSearchParams],
        priority: Sequence[int],
    ) -> list[str]:
        """Add one request per prompt, or none: on an error, those added are aborted."""
        request_ids = []
        try:
            for prompt, request_params, prio in zip(prompts, params, priority, strict=True):
                request_id = str(self._next_request_id)
                self._next_request_id += 1
                self.llm_engine.add_request(request_id, prompt, request_params, priority=prio)
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        return request_ids

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list, then generate.
        `tools`: OpenAI's function definitions, rendered into the prompt (the calls the model
        writes stay text here; the service's `/v1/chat/completions` parses them)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.llm_engine.tokenizer
        kwargs = {**(chat_template_kwargs or {}), "tools": tools}
        prompts, token_prompts = zip(
            *(apply_chat_template(tokenizer, list(c), **kwargs) for c in conversations),
            strict=True,
        )
        outputs = self.generate(list(token_prompts), sampling_params, use_tqdm)
        for output, prompt in zip(outputs, prompts, strict=True):
            output.prompt = prompt
        return outputs

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm)
        try:
            while self.llm_engine.has_unfinished_requests():
                for delta in self.llm_engine.step():
                    results[delta.request_id] = merge_delta(results.get(delta.request_id), delta)
                    if delta.finished:
                        bar.update(1)
        finally:
            bar.close()
        return [results[r] for r in request_ids]
