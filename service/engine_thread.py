"""The thread that owns an `LLMEngine`: every engine call of a worker happens here.

The asyncio side calls `add`, `abort` and `stop`; the thread drains its queue of commands,
runs `engine.step()` while there is work, blocks on the queue when idle (no busy spin: it
wakes once per `SESSION_TICK_S`, see below), and hands events back through `emit` (the
worker wraps `loop.call_soon_threadsafe`):
`StepOutputs` (a step's `RequestOutput` deltas), `RequestAborted`, `RequestFailed`. A request
that fails a step alone (the engine undoes a failed step and isolates its cause:
`RequestOutput.error`) fails by itself, dead-lettered, while its batch goes on; an exception
out of `engine.step()`, which the engine could not undo, fails every request. Either way the
thread keeps serving.

A request's prompt is tokenized (chat template included) on a tokenizer thread before the
engine sees it: on the engine thread, two 1M-character prompts stretched every running
request's inter-token gap from 0.1 s to 2.4 s (issue 12). It uses only what `engine` exports:
the worker never reaches into the engine's state.

A session's later turn comes with its history as Redis holds it (`AddCommand.history`): when
the engine holds the session with that very history, the turn continues it in place (its KV
kept); otherwise (the engine never had it, closed it, or holds an older turn of it that
another worker has since continued) a session the engine holds under that id is closed and the
turn is a new request over the whole history, recomputed. While sessions wait, an idle thread
still wakes every `SESSION_TICK_S` to step, so idle sessions are closed on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine import (
    BeamSearchParams,
    EngineStats,
    LLMEngine,
    RequestOutput,
    SamplingParams,
    apply_chat_continuation,
    apply_chat_template,
)
from queueing.schema import GenerateRequest, check_prompt_logprobs_size

logger = logging.getLogger("kvrail.worker.engine")
# How often an idle engine thread steps anyway: the engine closes sessions idle past its
# `session_timeout_s` in its steps.
SESSION_TICK_S = 1.0


@dataclass
class ResumeState:
    """What the response stream already holds for a redelivered request."""

    token_ids: dict[int, list[int]] = field(default_factory=dict)  # choice index -> emitted
    finished: set[int] = field(default_factory=set)  # choice indices that sent finish_reason


@dataclass
class AddCommand:
    """A request ready for the engine: parsed and tokenized on the tokenizer thread."""

    request: GenerateRequest
    params: SamplingParams | BeamSearchParams  # the latter with `GenerateRequest.beam_search`
    prompt: dict[str, Any]  # {"prompt": text or None, "prompt_token_ids": [...]}
    resume: ResumeState | None = None
    history: list[int] | None = None  # a session's later turn: every token of its turns so far


@dataclass
class AbortCommand:
    request_id: str
    # "abort" (client asked), "deadline", "unwritable" (its response key), "lost" (Redis lost
    # its entry: see `Worker._drop_lost`)
    reason: str


_STOP = object()  # abort everything silently (entries stay pending) and end the thread


@dataclass
class StepOutputs:
    """The deltas of one engine step (or the final output of a request resumed finished)."""

    outputs: list[RequestOutput]


@dataclass
class RequestAborted:
    request_id: str
    reason: str
    open_indices: list[int]  # choices that had not finished
    prompt_tokens: int


@dataclass
class RequestFailed:
    request_id: str
    error: str
    overloaded: bool  # the waiting queue was full: to retry later, not a dead letter
    invalid: bool = False  # the engine refused the request as given (ValueError, TypeError)


EngineEvent = StepOutputs | RequestAborted | RequestFailed


def request_failed(request_id: str, error: Exception) -> RequestFailed:
    """A request the engine does not take: a full waiting queue is overload, to retry later
    (not dead-lettered); anything else is a bad request, dead-lettered, and the request's own
    fault when the engine said so by a ValueError or TypeError (say priority 2 on an engine
    that schedules fcfs: a 500 schemathesis found, now a 400)."""
    if isinstance(error, OverflowError):
        return RequestFailed(request_id, f"{error}; retry later", overloaded=True)
    invalid = isinstance(error, ValueError | TypeError)
    return RequestFailed(request_id, str(error), overloaded=False, invalid=invalid)


class EngineThread(threading.Thread):
    """Drives one `LLMEngine`. `stats` is a snapshot taken after each round, safe to read from
    any thread; `num_added` counts requests given to the engine; `tokenizing` maps the id of
    each request whose prompt is being tokenized to the abort reason received meanwhile."""

    def __init__(self, engine: LLMEngine, emit: Callable[[EngineEvent], None]) -> None:
        super().__init__(name="kvrail-engine", daemon=True)
        self.engine = engine
        self.emit = emit
        self.inputs: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.stats: EngineStats = engine.get_stats()
        self.num_added = 0
        # One thread: requests reach the engine in the order they were read, and tokenizing
        # takes at most one core from the engine thread. The tokenizer releases the GIL (a
        # Python loop kept its pace while 300,000 characters were tokenized beside it), and
        # nothing here runs a torch op (profiled), so it starts no OpenMP pool (`load_engine`).
        self._tokenizer = ThreadPoolExecutor(1, thread_name_prefix="kvrail-tokenize")
        self._lock = threading.Lock()  # `tokenizing`, and the commands queued as it changes
        self.tokenizing: dict[str, str | None] = {}

    def add(
        self,
        request: GenerateRequest,
        resume: ResumeState | None = None,
        history: list[int] | None = None,
    ) -> None:
        """Thread-safe: tokenize the request's prompt on the tokenizer thread, then queue it
        for the engine; a bad one comes back as `RequestFailed`. `history`: a session's later
        turn, the tokens of its turns so far (its `messages` are templated after them)."""
        with self._lock:
            self.tokenizing[request.request_id] = None
        self._tokenizer.submit(self._prepare, request, resume, history)

    def abort(self, request_id: str, reason: str) -> None:
        """Thread-safe: abort a request given to `add` (`reason`: as `AbortCommand.reason`).
        One still being tokenized is aborted as soon as the engine has it,
        so the abort neither gets lost nor overtakes its request."""
        with self._lock:
            if request_id in self.tokenizing:
                self.tokenizing[request_id] = self.tokenizing[request_id] or reason
                return
        self.inputs.put(AbortCommand(request_id, reason))

    def stop(self) -> None:
        """Thread-safe: abort everything silently (entries stay pending) and end the thread."""
        self.inputs.put(_STOP)

    def _prepare(
        self, request: GenerateRequest, resume: ResumeState | None, history: list[int] | None
    ) -> None:
        """On the tokenizer thread: every check that needs no engine state (sampling fields,
        then the prompt, then the size of its logprobs), then queue the request for `_add`."""
        rid = request.request_id
        try:
            if request.beam_search is not None:
                params = BeamSearchParams(**request.beam_search)
            else:
                params = SamplingParams(**request.sampling)
            if request.messages is not None and history:
                tokenizer, messages = self.engine.tokenizer, request.messages
                prompt = apply_chat_continuation(tokenizer, messages, history)[1]
            elif request.messages is not None:
                prompt = apply_chat_template(self.engine.tokenizer, request.messages)[1]
            elif request.prompt_token_ids is not None:
                prompt = request.prompt_token_ids
            else:
                prompt = request.prompt
            text, prompt_token_ids = self.engine.tokenize_prompt(prompt)
            if isinstance(params, SamplingParams) and params.prompt_logprobs is not None:
                # They travel in one chunk: refuse a prompt whose chunk would be too large.
                check_prompt_logprobs_size(len(prompt_token_ids), params.prompt_logprobs)
        except Exception as e:  # a chat template can raise anything; unanswered, it would hang
            with self._lock:
                del self.tokenizing[rid]
            self.emit(request_failed(rid, e))
            return
        prompt = {"prompt": text, "prompt_token_ids": prompt_token_ids}
        with self._lock:
            reason = self.tokenizing.pop(rid)
            self.inputs.put(AddCommand(request, params, prompt, resume, history))
            if reason is not None:
                self.inputs.put(AbortCommand(rid, reason))

    def run(self) -> None:
        while True:
            # Block only when idle: with requests in flight, a step must not wait for input.
            commands = []
            if not self.engine.has_unfinished_requests():
                with contextlib.suppress(queue.Empty):
                    commands.append(self.inputs.get(timeout=SESSION_TICK_S))
            while True:
                try:
                    commands.append(self.inputs.get_nowait())
                except queue.Empty:
                    break
            events: list[EngineEvent] = []
            for command in commands:
                if command is _STOP:
                    self._tokenizer.shutdown(cancel_futures=True)  # no thread left behind
                    self.engine.abort_all()
                    self.stats = self.engine.get_stats()
                    return
                event = self._handle(command)
                if event is not None:
                    events.append(event)
            events.extend(self._step())  # with nothing to run, it only closes idle sessions
            # Snapshot before emitting: whoever sees an event then sees the blocks it freed.
            self.stats = self.engine.get_stats()
            for event in events:
                self.emit(event)

    def _handle(self, command: object) -> EngineEvent | None:
        if isinstance(command, AddCommand):
            return self._add(command)
        assert isinstance(command, AbortCommand), command
        request = self.engine.get_unfinished_request(command.request_id)
        if request is None:
            return None  # finished meanwhile: its final chunk is already on the way
        self.engine.abort_request(command.request_id)
        return RequestAborted(
            command.request_id, command.reason, request.open_indices, request.num_prompt_tokens
        )

    def _add(self, command: AddCommand) -> EngineEvent | None:
        """Add one request; one the engine refuses comes back as `RequestFailed`."""
        request, params = command.request, command.params
        try:
            resume = None
            if command.resume is not None:
                done, emitted = command.resume.finished, command.resume.token_ids
                # A beam search's choices all come in its last step's chunks (one batch).
                n = params.beam_width if isinstance(params, BeamSearchParams) else params.n
                resume = [None if i in done else emitted.get(i, []) for i in range(n)]
                if all(r is None for r in resume):
                    # Every choice had finished when the last worker died, before the usage
                    # chunk: only that chunk is missing.
                    prompt_token_ids = command.prompt["prompt_token_ids"]
                    final = RequestOutput(request.request_id, None, prompt_token_ids, [], True)
                    return StepOutputs([final])
            prompt, history = command.prompt, command.history
            held = self.engine.get_session_token_ids(request.request_id)
            if held is not None and (held != history or resume is not None):
                self.engine.abort_request(request.request_id)  # a stale session: closed
                held = None
            if history is not None and held is None:  # recomputed: one request over it all
                prompt = {**prompt, "prompt_token_ids": history + prompt["prompt_token_ids"]}
            self.engine.add_request(
                request.request_id,
                prompt,
                params,
                resume=resume,
                priority=request.priority,
                resumable=request.resumable,
            )
        except (OverflowError, ValueError, TypeError) as e:
            return request_failed(request.request_id, e)
        self.num_added += 1
        return None

    def _step(self) -> list[EngineEvent]:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # Not undone, so no request can be trusted to go on; the worker must not end:
            # fail them all (their KV is freed) and keep going with the next ones.
            logger.exception("engine step failed")
            failed = self.engine.abort_all()
            return [RequestFailed(rid, f"engine error: {e}", overloaded=False) for rid in failed]
        # A session the engine closed while it waited (finished, no outputs): its last turn
        # was answered in full, and the turn after it, if any, is recomputed.
        served = [o for o in outputs if o.error is None and (o.outputs or not o.finished)]
        events: list[EngineEvent] = [StepOutputs(served)] if served else []
        return events + [
            RequestFailed(o.request_id, f"engine error: {o.error}", overloaded=False)
            for o in outputs
            if o.error is not None
        ]


async def load_engine(**kwargs: Any) -> LLMEngine:
    """Build an `LLMEngine` (`LLMEngine.from_kwargs`) in a thread that has ended on return.

    OpenMP, which runs torch's CPU ops and the C kernels, keeps a pool of worker threads for
    every thread that has started a parallel region, for as long as that thread lives. With a
    second pool alive, libgomp shortens every spin-wait (more threads than cores), and the
    engine thread's steps ran 25-35% slower (measured: 48 requests in 10.4 s against 7.8 s on
    2 cores). Loading on the event loop's default executor left such a pool behind: that
    executor's threads outlive the load.
    """
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(1, thread_name_prefix="kvrail-load") as executor:
        return await loop.run_in_executor(
            executor, functools.partial(LLMEngine.from_kwargs, **kwargs)
        )
