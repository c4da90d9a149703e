"""EngineCore: the token-level loop of schedule -> execute -> update, owning KV and model."""

from __future__ import annotations

import logging
from pathlib import Path

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.model_runner import ModelRunner
from engine.outputs import EngineCoreOutput, EngineStats
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler

logger = logging.getLogger("kvrail.engine")


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        eos_token_id: int | None,
        calibration_token_ids: list[int],
    ) -> None:
        self.config = config
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
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                max_waiting_requests=config.max_waiting_requests,
            ),
            CacheConfig(config.block_size, num_blocks, config.enable_prefix_caching),
        )
        self.model_runner.initialize_kv_cache(num_blocks)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Finish live requests as aborted; their blocks are free on return."""
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests_by_stop_string(self, stops: dict[str, str]) -> None:
        for req_id, stop in stops.items():
            self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_STOPPED, stop)

    def step(self) -> list[EngineCoreOutput]:
        """One engine iteration. Returns the tokens each request produced in it."""
        if not self.scheduler.has_unfinished_requests() and not self.scheduler.finished_req_ids:
            return []
        scheduler_output = self.scheduler.schedule()
        # Runs even with nothing scheduled, so the runner drops finished requests' state.
        runner_output = self.model_runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> EngineStats:
        return self.scheduler.make_stats()
