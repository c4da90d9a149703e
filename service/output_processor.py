"""Engine events -> `TokenChunk`s: the worker's output processor.

Each event of the engine thread (`StepOutputs`, `RequestAborted`, `RequestFailed`) becomes the
chunks of the requests it concerns, numbered per request (`Inflight.chunk`), queued on the
publisher as one `Batch`. A request's last chunk carries its usage, with the prompt tokens the
engine found in the prefix cache (OpenAI's `prompt_tokens_details.cached_tokens`); the entry's
XACK and done mark ride in the same batch, after the chunks. Token and request metrics are
observed here, labelled with the served model's name.

A session's turn is over when its choice finishes (the engine's output is not `finished`
then: the session waits): its last chunk carries the turn's usage, its entry is acknowledged
and the session marked "waiting". Its first chunk carries the turn's own prompt tokens, which
later turns' histories are built from (`queueing.schema.session_history`).
"""

from __future__ import annotations

import time

from engine import FinishReason, RequestOutput
from service import metrics
from service.delivery import Inflight
from service.engine_thread import EngineEvent, RequestAborted, RequestFailed, StepOutputs
from service.publisher import Batch, Publisher


class OutputProcessor:
    """Turns engine events into chunks for the requests in `inflight`, which it retires."""

    def __init__(
        self, inflight: dict[str, Inflight], publisher: Publisher, model_name: str
    ) -> None:
        self.inflight = inflight  # request_id -> state, shared with the worker
        self.publisher = publisher
        self.model_name = model_name  # the metrics' label

    def process(self, event: EngineEvent) -> None:
        batch = Batch()
        match event:
            case StepOutputs(outputs):
                for output in outputs:
                    self._on_output(output, batch)
            case RequestAborted():
                self._on_aborted(event, batch)
            case RequestFailed():
                self._on_failed(event, batch)
        if batch.chunks:
            self.publisher.put(batch)

    def _on_output(self, output: RequestOutput, batch: Batch) -> None:
        f = self.inflight.get(output.request_id)
        if f is None:
            return
        key, now = f.request.response_key, time.time()
        f.num_cached_tokens = output.num_cached_tokens
        num_new, last = 0, None
        for c in output.outputs:
            if not (c.token_ids or c.text or c.finish_reason):
                continue
            logprobs = None
            if c.logprobs is not None:
                logprobs = [[[t, lp.logprob] for t, lp in d.items()] for d in c.logprobs]
            prompt_logprobs = None
            if output.prompt_logprobs is not None and c.index == 0:
                # With choice 0's first token, in its chunk: a resume then knows from choice
                # 0's emitted tokens whether they were sent (see `LLMEngine.add_request`).
                prompt_logprobs = [
                    None if d is None else [[t, lp.logprob, lp.rank] for t, lp in d.items()]
                    for d in output.prompt_logprobs
                ]
            turn_prompt = None  # a session turn's first chunk: its prompt, past the history
            if f.num_history_tokens is not None:
                turn_prompt = output.prompt_token_ids[f.num_history_tokens :]
                f.num_history_tokens = None
            chunk = f.chunk(
                index=c.index,
                token_ids=list(c.token_ids),
                text=c.text,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_token_ids=turn_prompt,
            )
            batch.add_chunk(key, chunk, f.entry_id, f.data)
            num_new, last = num_new + len(c.token_ids), chunk
        if num_new:
            if f.last_token_s is None:
                ttft = max(0.0, now - f.enqueued_s)
                metrics.time_to_first_token_seconds.labels(self.model_name).observe(ttft)
            else:
                itl = now - f.last_token_s
                metrics.inter_token_latency_seconds.labels(self.model_name).observe(itl)
            f.last_token_s = now
            f.completion_tokens += num_new
            metrics.generation_tokens.labels(self.model_name).inc(num_new)
        turn_ended = f.request.resumable and last is not None and last.finish_reason is not None
        if output.finished or turn_ended:
            if last is None:  # resumed with every choice done: only the usage chunk is due
                batch.add_chunk(key, f.chunk(), f.entry_id, f.data)
            reason = last.finish_reason if last is not None else FinishReason.STOP
            self._finish(f, batch, len(output.prompt_token_ids), reason, waits=turn_ended)

    def _on_aborted(self, event: RequestAborted, batch: Batch) -> None:
        f = self.inflight.get(event.request_id)
        if f is None:
            return
        key = f.request.response_key
        if event.reason == "deadline":
            error = f.chunk(finish_reason="error", error="deadline exceeded")
            batch.add_chunk(key, error, f.entry_id, f.data)
        else:
            for index in event.open_indices or [0]:
                abort = f.chunk(index=index, finish_reason=FinishReason.ABORT)
                batch.add_chunk(key, abort, f.entry_id, f.data)
        self._finish(f, batch, event.prompt_tokens, event.reason)

    def _on_failed(self, event: RequestFailed, batch: Batch) -> None:
        f = self.inflight.pop(event.request_id, None)
        if f is None:
            return
        f.log.warning("request failed", reason=event.error)
        error = f.chunk(
            finish_reason="error", error=event.error, retry=event.overloaded, invalid=event.invalid
        )
        batch.add_chunk(f.request.response_key, error, f.entry_id, f.data)
        if not event.overloaded:
            batch.dead.append((f.entry_id, f.data, event.error))
        batch.acks.append(f.entry_id)
        batch.done.append(event.request_id)

    def _finish(
        self, f: Inflight, batch: Batch, prompt_tokens: int, reason: str, waits: bool = False
    ) -> None:
        """Put usage on the request's last chunk and schedule its XACK after it is stored;
        `waits`: a session's turn, the session left open."""
        batch.chunks[-1][1].usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": f.completion_tokens,
            "total_tokens": prompt_tokens + f.completion_tokens,
            # A resumed request's hits can reach into the output it recomputes.
            "cached_tokens": min(f.num_cached_tokens, prompt_tokens),
        }
        del self.inflight[f.request.request_id]
        batch.acks.append(f.entry_id)
        (batch.waiting if waits else batch.done).append(f.request.request_id)
        metrics.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        metrics.request_success.labels(self.model_name, reason).inc()
        e2e = max(0.0, time.time() - f.enqueued_s)
        metrics.e2e_request_latency_seconds.labels(self.model_name).observe(e2e)
        f.log.info("request finished", reason=reason, completion_tokens=f.completion_tokens)
