"""The thread that owns an `LLMEngine`: every engine call of a worker happens here.

The asyncio side submits commands (`AddCommand`, `AbortCommand`, `STOP`) to a thread-safe
queue; the thread drains it, runs `engine.step()` while there is work, blocks on the queue when
idle (no busy spin), and hands events back through `emit` (the worker wraps
`loop.call_soon_threadsafe`): `StepOutputs` (a step's `RequestOutput` deltas), `RequestAborted`,
`RequestFailed`. An exception in a step fails that step's requests; the thread keeps serving.
It uses only what `engine` exports: the worker never reaches into the engine's state.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine import EngineStats, LLMEngine, RequestOutput, SamplingParams, apply_chat_template
from queueing.schema import GenerateRequest, check_prompt_logprobs_size

logger = logging.getLogger("kvrail.worker.engine")


@dataclass
class ResumeState:
    """What the response stream already holds for a redelivered request."""

    token_ids: dict[int, list[int]] = field(default_factory=dict)  # choice index -> emitted
    finished: set[int] = field(default_factory=set)  # choice indices that sent finish_reason


@dataclass
class AddCommand:
    request: GenerateRequest
    resume: ResumeState | None = None


@dataclass
class AbortCommand:
    request_id: str
    reason: str  # "abort" (client asked), "deadline" or "unwritable" (its response key)


STOP = object()  # abort everything silently (entries stay pending) and end the thread


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
    dead_letter: bool  # a bad request or an engine fault, as opposed to overload


EngineEvent = StepOutputs | RequestAborted | RequestFailed


class EngineThread(threading.Thread):
    """Drives one `LLMEngine`. `stats` is a snapshot taken after each round, safe to read from
    any thread; `num_added` counts requests given to the engine."""

    def __init__(self, engine: LLMEngine, emit: Callable[[EngineEvent], None]) -> None:
        super().__init__(name="kvrail-engine", daemon=True)
        self.engine = engine
        self.emit = emit
        self.inputs: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.stats: EngineStats = engine.get_stats()
        self.num_added = 0

    def submit(self, command: object) -> None:
        """Thread-safe: queue a command for the engine."""
        self.inputs.put(command)

    def run(self) -> None:
        while True:
            # Block only when idle: with requests in flight, a step must not wait for input.
            commands = [] if self.engine.has_unfinished_requests() else [self.inputs.get()]
            while True:
                try:
                    commands.append(self.inputs.get_nowait())
                except queue.Empty:
                    break
            events: list[EngineEvent] = []
            for command in commands:
                if command is STOP:
                    self.engine.abort_all()
                    self.stats = self.engine.get_stats()
                    return
                event = self._handle(command)
                if event is not None:
                    events.append(event)
            if self.engine.has_unfinished_requests():
                events.extend(self._step())
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
        """Validate and add one request; a bad one comes back as `RequestFailed`."""
        request = command.request
        try:
            params = SamplingParams(**request.sampling)
            prompt = self._prompt(request)
            if params.prompt_logprobs is not None:
                # They travel in one chunk: refuse a prompt whose chunk would be too large.
                _, prompt = self.engine.tokenize_prompt(prompt)
                check_prompt_logprobs_size(len(prompt), params.prompt_logprobs)
            resume = None
            if command.resume is not None:
                done, emitted = command.resume.finished, command.resume.token_ids
                resume = [None if i in done else emitted.get(i, []) for i in range(params.n)]
                if all(r is None for r in resume):
                    # Every choice had finished when the last worker died, before the usage
                    # chunk: only that chunk is missing.
                    _, prompt_token_ids = self.engine.tokenize_prompt(prompt)
                    final = RequestOutput(request.request_id, None, prompt_token_ids, [], True)
                    return StepOutputs([final])
            self.engine.add_request(request.request_id, prompt, params, resume=resume)
        except OverflowError as e:
            return RequestFailed(request.request_id, f"{e}; retry later", dead_letter=False)
        except (ValueError, TypeError) as e:
            return RequestFailed(request.request_id, str(e), dead_letter=True)
        self.num_added += 1
        return None

    def _prompt(self, request: GenerateRequest) -> str | list[int]:
        if request.messages is not None:
            return apply_chat_template(self.engine.tokenizer, request.messages)[1]
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        return request.prompt

    def _step(self) -> list[EngineEvent]:
        try:
            outputs = self.engine.step()
        except Exception as e:
            # A fault in one step must not end the worker: fail the requests it was serving
            # (their KV is freed) and keep going with the next ones.
            logger.exception("engine step failed")
            failed = self.engine.abort_all()
            return [RequestFailed(rid, f"engine error: {e}", dead_letter=True) for rid in failed]
        return [StepOutputs(outputs)] if outputs else []


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
