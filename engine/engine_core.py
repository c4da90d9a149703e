"""EngineCore: the token-level loop of schedule -> execute -> update, owning KV and model.

A step serves many requests, and a fault tied to one of them (issue 12: a seed that
overflowed torch's generator) surfaces inside the shared step. The core makes such a step
undoable, so that it can step subsets of its requests and fail only the culprit: the
isolation belongs here, below `LLMEngine`, because only the core knows which requests a step
served and how to take it back; every caller (`LLM.generate`, the service's engine thread)
then sees one request fail instead of a batch.

The core also owns the `StructuredOutputManager` (vLLM's place for it): grammars compile off
its thread, and a request whose grammar cannot be built fails alone, the same way.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.model_runner import ModelRunner
from engine.outputs import EngineCoreOutput, EngineStats
from engine.request import FinishReason, Request, RequestStatus
from engine.scheduler import Scheduler
from engine.structured_outputs import StructuredOutputManager

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("kvrail.engine")
# A step that schedules nothing while grammars compile waits this long at most for one
# instead of spinning (a typical compile takes 7-12 ms here); commands wait as long.
_COMPILE_WAIT_S = 0.01


class StepFailed(Exception):
    """A step's model run raised (the cause) and was undone: `request_ids` are the requests
    it served, each back in the waiting queue to be recomputed."""

    def __init__(self, request_ids: list[str]) -> None:
        super().__init__(f"a step of {len(request_ids)} requests failed")
        self.request_ids = request_ids


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        tokenizer: PreTrainedTokenizerBase,
        calibration_token_ids: list[int],
    ) -> None:
        self.config = config
        eos_token_id = tokenizer.eos_token_id
        self.model_runner = ModelRunner(
            config, model_dir, config.max_model_len, eos_token_id, calibration_token_ids
        )
        num_blocks = config.num_kv_blocks or self.model_runner.determine_num_kv_blocks()
        max_model_len = self.model_runner.max_model_len
        if config.max_model_len is None and max_model_len > num_blocks * config.block_size:
            max_model_len = num_blocks * config.block_size
            logger.warning("max_model_len lowered to %d to fit the KV pool", max_model_len)
        self.max_model_len = max_model_len
        self.vocab_size = self.model_runner.vocab_size
        spec = config.speculative_config
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                max_waiting_requests=config.max_waiting_requests,
                policy=config.scheduling_policy,
                session_timeout_s=config.session_timeout_s,
                num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                num_lookahead_tokens=spec.num_speculative_tokens
                if spec and spec.method == "draft_model"
                else 0,
            ),
            CacheConfig(config.block_size, num_blocks, config.enable_prefix_caching),
        )
        self.model_runner.initialize_kv_cache(num_blocks)
        self.structured_output_manager = StructuredOutputManager(
            tokenizer, self.vocab_size, eos_token_id
        )

    def add_request(self, request: Request) -> None:
        """Queue a request (`Scheduler.add_request`) and start building its grammar; raises
        `ValueError` if its grammar refuses the tokens it resumes with."""
        self.scheduler.add_request(request)
        if request.use_structured_output:
            try:
                self.structured_output_manager.grammar_init(request)
            except ValueError:
                self.abort_requests([request.request_id])
                raise

    def fork_request(self, parent_id: str, child: Request) -> None:
        """Queue `child`, sharing the KV blocks of the finished `parent_id` (beam search:
        `Scheduler.fork_request`)."""
        self.scheduler.fork_request(parent_id, child)

    def release_blocks(self, request_ids: list[str]) -> None:
        """Free the blocks finished requests kept for their forks (`Request.keep_blocks`)."""
        self.scheduler.release_blocks(request_ids)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Finish live requests as aborted; their blocks are free on return."""
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def close_idle_sessions(self) -> list[str]:
        """Close the sessions idle past `session_timeout_s` (`Scheduler.close_idle_sessions`)."""
        return self.scheduler.close_idle_sessions()

    def finish_requests_by_stop_string(self, stops: dict[str, str]) -> None:
        for req_id, stop in stops.items():
            self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_STOPPED, stop)

    def step(self) -> list[EngineCoreOutput]:
        """One engine iteration. Returns the tokens each request produced in it, or for a
        request that failed it (see `_isolate`), its error."""
        if not self.scheduler.has_unfinished_requests() and not self.scheduler.finished_req_ids:
            return []
        outputs = []
        if self.structured_output_manager.is_compiling:
            outputs += self._start_grammars()
        try:
            return outputs + self._step()
        except StepFailed as failure:
            return outputs + self._isolate(failure)

    def _start_grammars(self) -> list[EngineCoreOutput]:
        """Hand compiled grammars to their requests (the scheduler runs them from now on);
        abort those whose grammar failed, each with its error."""
        outputs = []
        for req_id, error in self.structured_output_manager.update():
            logger.warning("request %s failed: %s", req_id, error)
            self.abort_requests([req_id])
            outputs.append(
                EngineCoreOutput(req_id, [], finish_reason=FinishReason.ABORT, error=error)
            )
        return outputs

    def _step(self, request_ids: set[str] | None = None) -> list[EngineCoreOutput]:
        """Schedule (only `request_ids`, if given), execute, update. A model run that raises
        is undone, then reported as `StepFailed` naming the requests the step served."""
        scheduler_output = self.scheduler.schedule(request_ids)
        manager = self.structured_output_manager
        if not scheduler_output.num_scheduled_tokens and manager.is_compiling:
            manager.wait_for_compile(_COMPILE_WAIT_S)
        try:
            # Runs even with nothing scheduled, so the runner drops finished requests' state.
            runner_output = self.model_runner.execute_model(scheduler_output)
        except Exception as e:
            self.scheduler.undo_step(scheduler_output)
            raise StepFailed(list(scheduler_output.num_scheduled_tokens)) from e
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _isolate(self, failure: StepFailed) -> list[EngineCoreOutput]:
        """Binary splitting over the requests of a failed (undone) step: each half of a
        failed group steps alone, the others held aside. A half that steps cleanly is cleared
        (its tokens are this step's output); one that raises is split again; a request that
        raises alone fails, aborted with its error.

        Each request steps cleanly at most once and groups halve, so a culprit is found
        after log2(n) rounds of at most two steps, and a fault in every step (the model
        itself) fails each of the n requests after at most 2n - 2 retries. A fault that does
        not come back (a transient one) fails nobody, unless its step served one request.
        """
        logger.warning("a step of %d requests failed, isolating", len(failure.request_ids))
        outputs: list[EngineCoreOutput] = []
        failed = [failure]
        while failed:
            failure = failed.pop()
            group = failure.request_ids
            if len(group) > 1:
                for half in (group[: len(group) // 2], group[len(group) // 2 :]):
                    try:
                        outputs += self._step(set(half))
                    except StepFailed as half_failure:
                        failed.append(half_failure)
            elif group:  # none when the step had served none of its group: nobody to blame
                error = failure.__cause__
                logger.error("request %s failed a step alone", group[0], exc_info=error)
                self.abort_requests(group)
                outputs.append(
                    EngineCoreOutput(
                        group[0],
                        [],
                        finish_reason=FinishReason.ABORT,
                        error=f"{type(error).__name__}: {error}",
                    )
                )
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> EngineStats:
        return self.scheduler.make_stats()
