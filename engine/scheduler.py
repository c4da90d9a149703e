"""The vLLM-v1 scheduler: one token budget per step, running requests first, then waiting ones.

There are no prefill and decode phases: each request has `num_computed_tokens` and
`num_tokens`, and a step gives each request some of the tokens it lacks. That one rule gives
continuous batching, chunked prefill mixed with decodes, and recompute after preemption.

Speculative decoding adds no phase either: a running request's draft tokens
(`spec_token_ids`) are more tokens it lacks, scheduled within the budget like any other.
After the step, the drafts the target rejected are taken back from `num_computed_tokens`:
their slots are overwritten later, and as blocks are cached only up to the request's known
tokens (`KVCacheManager.allocate_slots`), a draft never reaches the prefix cache.

Structured outputs (`engine/structured_outputs.py`) add a state and two duties: a request
whose grammar still compiles waits (`WAITING_FOR_FSM`) while the requests behind it run; each
step fills the grammar bitmask of the constrained requests that sample, and each appended
token advances the request's matcher (drafts are cut to what the grammar allows). A scheduler
without a constrained request does neither.

The scheduling policy (vLLM's `scheduling_policy`) is only where a request is put in the two
queues. Under "fcfs" `waiting` is in arrival order (a preempted request back at its head) and
`running` in admission order. Under "priority" both are kept sorted by (priority, arrival):
the waiting request admitted next is the one with the lowest key, the running requests get
the budget in key order, and the one preempted under KV pressure, the last of `running`, is
the lowest priority, then the latest. A waiting request that finds every seat taken by
requests it outranks preempts the lowest of them for its seat (vLLM v0's priority
preemption; v1 makes it wait for the next seat to free). A step that computes a prompt of
some priority computes no prompt of a lower one, only its decodes (`_prefill_rank`): the
newcomer's first token waits for its own prompt, not the backlog's. Equal priorities never
preempt or hold back each other and are served first come, first served, so none of them
starves.

A finished request may keep its KV blocks (`kept`, out of both queues) for the requests that
continue it, and two kinds do:
- a streaming-input session (vLLM's WAITING_FOR_INPUT): a resumable request whose turn ends
  waits there, and its next turn, a new request over the whole history, takes its blocks
  over for the tokens both begin with, so only the new tokens (and the last sampled one, whose
  KV was never written) are computed; one idle past `session_timeout_s` is closed;
- a beam search's beam (`engine/beam_search.py`, `Request.keep_blocks`): each request forked
  from it (`fork_request`) shares its blocks by reference count and waits, holding them, as a
  new request until admitted; then `release_blocks` lets the parent's go.
Kept blocks never stall the live requests: under KV pressure they go first, the request kept
longest first, before any running request is preempted; its continuation recomputes them
(the prefix cache still finds the full blocks nobody reused). A waiting request that cannot
get its slots while nothing runs makes the waiting forks give theirs up, as no running
request would ever free any.
"""

from __future__ import annotations

import time
from bisect import insort
from collections import deque
from collections.abc import Container, Iterable, Sequence
from operator import attrgetter

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache import KVCacheBlock, KVCacheManager
from engine.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    EngineStats,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from engine.request import Request, RequestStatus, check_prompt_len
from engine.structured_outputs import grammar_bitmask

# The order of both queues under the "priority" policy: the first runs first, the last is
# preempted first.
_PRIORITY_ORDER = attrgetter("priority", "arrival_order")


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        if scheduler_config.max_model_len > cache_config.num_blocks * cache_config.block_size:
            # Otherwise a lone request could need more blocks than exist and preempt itself forever.
            raise ValueError(
                f"max_model_len {scheduler_config.max_model_len} exceeds the KV pool "
                f"({cache_config.num_blocks} blocks of {cache_config.block_size} tokens); "
                "lower max_model_len or give the cache more memory"
            )
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.requests: dict[str, Request] = {}  # live (unfinished) requests
        self.by_priority = scheduler_config.policy == "priority"
        self.waiting: deque[Request] = deque()
        # In admission order (fcfs) or `_PRIORITY_ORDER`: the last is preempted first.
        self.running: list[Request] = []
        # Finished requests keeping their blocks (sessions, beam parents), in the order they
        # finished: the first is evicted first under KV pressure (a session times out first).
        self.kept: dict[str, Request] = {}
        self.num_arrivals = 0
        self.finished_req_ids: set[str] = set()  # since the last schedule()
        self.preempted_req_ids: set[str] = set()  # since the last schedule()
        self.num_structured_output_reqs = 0  # live requests with a grammar
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # prompt tokens computed (not found in the cache or kept)
        k = scheduler_config.num_speculative_tokens
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * k

    def add_request(self, request: Request) -> None:
        """Queue a new request, or the next turn of the session of its id (see `_take_over`).
        The caller validated it; ids must be unique among live requests."""
        check_prompt_len(request.num_prompt_tokens, self.config.max_model_len)
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise OverflowError(
                f"waiting queue is full ({self.config.max_waiting_requests} requests)"
            )
        session = self.kept.get(request.request_id)
        if session is not None and session.resumable:
            self._take_over(self.kept.pop(request.request_id), request)
        request.arrival_order = self.num_arrivals
        self.num_arrivals += 1
        self.requests[request.request_id] = request
        self._enqueue(self.waiting, request)
        self.num_structured_output_reqs += request.use_structured_output

    def _take_over(self, session: Request, request: Request) -> None:
        """`request`, a session's next turn over its whole history, keeps the session's KV for
        the tokens both begin with: all the session computed, unless the history it is given
        was cut (a stop string inside a step's accepted drafts), and never `request`'s last
        token, whose logits are needed. A block the next tokens would write into is kept only
        if it is the session's own (not in the prefix cache, so shared with no one). A turn
        asking for prompt logprobs keeps nothing: every position of its prompt needs logits,
        as it takes no prefix-cache hit either."""
        limit = min(session.num_computed_tokens, request.num_tokens - 1)
        if request.sampling_params.prompt_logprobs is not None:
            limit = 0
        num_common = _num_common_tokens(
            session.all_token_ids[:limit], request.all_token_ids[:limit]
        )
        request.num_computed_tokens = self.kv_cache_manager.truncate(request, num_common)
        request.block_hashes = session.block_hashes[: num_common // self.block_size]

    def close_idle_sessions(self) -> list[str]:
        """Close the sessions waiting for input longer than `session_timeout_s`, freeing
        their blocks; returns their ids."""
        deadline = time.monotonic() - self.config.session_timeout_s
        closed = []
        for request in self.kept.values():  # in the order they began waiting
            if not request.resumable:
                continue  # a beam's parent, released within its step
            if request.waiting_since > deadline:
                break
            closed.append(request.request_id)
        for req_id in closed:
            self.kv_cache_manager.free(self.kept.pop(req_id))
        return closed

    def _allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """`KVCacheManager.allocate_slots`, evicting the KV of kept requests (the one kept
        longest first) while the pool has no room; None when there is none left to evict."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, computed_blocks, self._lookahead(request)
            )
            if new_blocks is not None:
                return new_blocks
            kept = next((r for r in self.kept.values() if r.num_computed_tokens), None)
            if kept is None:
                return None
            self.kv_cache_manager.free(kept)
            kept.num_computed_tokens = 0  # its continuation recomputes it

    def schedule(self, request_ids: Container[str] | None = None) -> SchedulerOutput:
        """Spend this step's `token_budget`; see the module docstring. Mutates request state.

        With `request_ids`, only those requests get tokens: the others are held aside (the
        running keep their blocks, the waiting their place), as `EngineCore` isolates a fault.
        """
        token_budget = self.config.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        preempted: list[Request] = []
        new_reqs: list[Request] = []
        resumed_reqs: list[Request] = []
        new_block_ids: dict[str, list[int]] = {}
        spec_tokens: dict[str, list[int]] = {}
        prefill_rank = None  # lower priorities (higher values) compute no prompt this step
        if self.by_priority and request_ids is None:
            self._free_seats()
            prefill_rank = self._prefill_rank()

        # Running requests first: each gets the tokens it lacks (its drafts too), chunked by
        # the budget.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = self._clip(
                request.num_tokens + len(request.spec_token_ids) - request.num_computed_tokens,
                token_budget,
            )
            if (
                num_new_tokens == 0
                or (request_ids is not None and request.request_id not in request_ids)
                or (
                    prefill_rank is not None
                    and request.priority > prefill_rank
                    and _in_prefill(request)
                )
            ):
                req_index += 1
                continue
            while True:
                new_blocks = self._allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    break
                # The latest admitted (fcfs), the lowest priority then latest (priority): never
                # one this loop has scheduled already, as it serves `running` from the front.
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            num_scheduled_tokens[request.request_id] = num_new_tokens
            new_block_ids[request.request_id] = [b.block_id for b in new_blocks]
            num_spec = request.num_computed_tokens + num_new_tokens - request.num_tokens
            if num_spec > 0:
                spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            token_budget -= num_new_tokens
            req_index += 1

        # Then waiting ones, in queue order, while there is budget, room in the batch and KV room.
        for request in self.waiting:
            if token_budget <= 0 or preempted or len(self.running) >= self.config.max_num_seqs:
                break
            if prefill_rank is not None and request.priority > prefill_rank:
                break  # the rest rank lower still
            if request_ids is not None and request.request_id not in request_ids:
                continue
            if _compiling(request):
                continue  # the requests behind it go first
            if request.status == RequestStatus.WAITING_FOR_FSM:
                request.status = RequestStatus.WAITING
            computed_blocks, num_hit_tokens = [], 0
            if request.num_computed_tokens == 0:
                computed_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = self._clip(
                request.num_tokens - request.num_computed_tokens - num_hit_tokens, token_budget
            )
            new_blocks = self._allocate_slots(request, num_new_tokens, computed_blocks)
            if new_blocks is None:
                if not self.running:  # the forks waiting with blocks give them up (see above)
                    for fork in self.waiting:
                        self.kv_cache_manager.free(fork)
                        fork.num_computed_tokens = 0
                break
            request.num_computed_tokens += num_hit_tokens
            if request.num_cached_tokens < 0:  # hits, and a session's turn the KV it kept
                request.num_cached_tokens = request.num_computed_tokens
            if request.status == RequestStatus.PREEMPTED:
                resumed_reqs.append(request)
            else:
                new_reqs.append(request)
            request.status = RequestStatus.RUNNING
            self._enqueue(self.running, request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
        for request in new_reqs + resumed_reqs:
            self.waiting.remove(request)  # the first ones, unless some were held aside

        output = self._make_output(num_scheduled_tokens, new_reqs, resumed_reqs, new_block_ids)
        output.scheduled_spec_decode_tokens = spec_tokens
        kv = self.kv_cache_manager
        output.blocks_to_copy, kv.blocks_to_copy = kv.blocks_to_copy, []
        # Counters advance now: the next schedule() sees this step's tokens as computed.
        for req_id, num_tokens in num_scheduled_tokens.items():
            request = self.requests[req_id]
            num_computed = request.num_computed_tokens
            prompt_end = min(num_computed + num_tokens, request.num_prompt_tokens)
            self.num_prefill_tokens += max(0, prompt_end - num_computed)
            request.num_computed_tokens += num_tokens
        if self.num_structured_output_reqs:
            self._fill_grammar_bitmask(output)
        self.finished_req_ids, self.preempted_req_ids = set(), set()
        return output

    def _fill_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """The bitmask rows of the constrained requests this step samples (those it brings
        to the end of their tokens and drafts), in the order they were scheduled."""
        rows = []
        row = 0
        for req_id in output.num_scheduled_tokens:
            request = self.requests[req_id]
            drafts = output.scheduled_spec_decode_tokens.get(req_id, [])
            samples = request.num_computed_tokens == request.num_tokens + len(drafts)
            if request.grammar is None or not samples:
                continue
            output.structured_output_request_ids[req_id] = row
            rows.append((request.grammar, drafts))
            row += len(drafts) + 1
        if rows:
            output.grammar_bitmask = grammar_bitmask(rows)

    def fork_request(self, parent_id: str, child: Request) -> None:
        """Queue `child`, which continues `parent_id`, a finished request that kept its blocks
        (`Request.keep_blocks`): the child's tokens extend the parent's computed ones, whose blocks
        it shares (`KVCacheManager.fork`) instead of computing them again. It waits at the head
        of the queue (under priority, at the parent's place) as a new request: the model runner
        gets its block table whole, copies on write included, when it is admitted."""
        parent = self.kept.get(parent_id)
        if parent is None or not parent.keep_blocks:
            raise ValueError(f"request {parent_id!r} is not a finished request keeping its blocks")
        if child.request_id in self.requests:
            raise ValueError(f"request_id {child.request_id!r} is already running")
        num_tokens = parent.num_computed_tokens
        if not (
            child.num_tokens > num_tokens
            and child.all_token_ids[:num_tokens] == parent.all_token_ids[:num_tokens]
        ):
            raise ValueError("a fork's tokens must extend its parent's computed tokens")
        check_prompt_len(child.num_prompt_tokens, self.config.max_model_len)
        child.arrival_order = parent.arrival_order
        child.num_computed_tokens = self.kv_cache_manager.fork(parent, child)
        self.requests[child.request_id] = child
        self._enqueue(self.waiting, child, at_head=True)

    def release_blocks(self, request_ids: Iterable[str]) -> None:
        """Free the blocks that these finished requests kept for their forks."""
        for req_id in request_ids:
            request = self.kept.pop(req_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)

    def _clip(self, num_new_tokens: int, token_budget: int) -> int:
        """Chunk a request's missing tokens by the long-prefill threshold and the budget."""
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        return min(num_new_tokens, token_budget)

    def _lookahead(self, request: Request) -> int:
        """KV slots reserved past the step's tokens for the draft model's drafts, within
        max_model_len (a draft is never proposed past it)."""
        room = self.config.max_model_len - request.num_tokens
        return max(0, min(self.config.num_lookahead_tokens, room))

    def _free_seats(self) -> None:
        """Under the priority policy, before the step's budget is spent: each waiting request
        that finds every seat taken and outranks the lowest running request (strictly: equal
        priorities never preempt each other) takes that one's seat, as vLLM v0's priority
        preemption does. Waiting for a seat to free would tie a high priority's TTFT to the
        backlog's completions (benchmarks/priority.py: 7.7x its idle TTFT p99). The preempted
        have nothing scheduled yet this step and are recomputed later."""
        num_free = self.config.max_num_seqs - len(self.running)
        victims: list[Request] = []
        for request in self.waiting:
            if _compiling(request):
                continue  # takes no seat this step
            if num_free > 0:
                num_free -= 1
                continue
            lowest = len(self.running) - 1 - len(victims)
            if lowest < 0 or _PRIORITY_ORDER(request) >= _PRIORITY_ORDER(self.running[lowest]):
                break
            victims.append(self.running[lowest])
        for victim in victims:
            self.running.pop()
            self._preempt(victim)

    def _prefill_rank(self) -> int | None:
        """Under the priority policy: the highest priority (lowest value) with prompt tokens to
        compute this step, among the running requests and the waiting one admitted next (if a
        seat is free for it and the free blocks hold its first chunk: else the lower prompts
        holding blocks would wait for it, and it for their blocks). Requests ranking below it
        compute none of their prompts in this step, only their decodes: a step's length is
        what a newcomer's TTFT waits on, and on these CPUs it grows with the prompt tokens in
        it (about 1 ms each for the default model in bf16, `benchmarks/priority.py`), so a
        high priority's prefill step carries no backlog prefill."""
        rank = next((r.priority for r in self.running if _in_prefill(r)), None)  # sorted
        if len(self.running) < self.config.max_num_seqs:
            head = next((r for r in self.waiting if not _compiling(r)), None)
            if (
                head is not None
                and (rank is None or head.priority < rank)
                and self.kv_cache_manager.can_allocate(
                    head,
                    self._clip(
                        head.num_tokens - head.num_computed_tokens,
                        self.config.max_num_batched_tokens,
                    ),
                    self._lookahead(head),
                )
            ):
                rank = head.priority
        return rank

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the KV, back to the head of the waiting queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        self.preempted_req_ids.add(request.request_id)
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # waiting requests carry no drafts
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(self.waiting, request, at_head=True)

    def _enqueue(
        self, queue: deque[Request] | list[Request], request: Request, at_head: bool = False
    ) -> None:
        """Put a request in `waiting` or `running`: at its place in `_PRIORITY_ORDER` under
        the priority policy, else at the end, or `at_head` (a preempted or undone one)."""
        if self.by_priority:
            insort(queue, request, key=_PRIORITY_ORDER)
        elif at_head:
            queue.appendleft(request)
        else:
            queue.append(request)

    def undo_step(self, scheduler_output: SchedulerOutput) -> None:
        """Take back a step whose execution raised: its requests return to the head of the
        waiting queue in their order (under priority, to their places), to be recomputed (the
        new ones as new: the runner forgot them), and the blocks it was to fill leave the
        prefix cache, as their KV may be missing. Preemptions it made stand: they only cost a
        recompute."""
        self.finished_req_ids |= scheduler_output.finished_req_ids
        self.preempted_req_ids |= scheduler_output.preempted_req_ids
        new_req_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        scheduled = scheduler_output.num_scheduled_tokens
        for request in reversed([r for r in self.running if r.request_id in scheduled]):
            self.running.remove(request)
            num_computed_before = request.num_computed_tokens - scheduled[request.request_id]
            self.kv_cache_manager.uncache_blocks(request, num_computed_before)
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            if request.request_id in new_req_ids:
                request.status, request.num_cached_tokens = RequestStatus.WAITING, -1
            else:
                request.status = RequestStatus.PREEMPTED
                self.preempted_req_ids.add(request.request_id)
            request.spec_token_ids = []
            self._enqueue(self.waiting, request, at_head=True)

    def _make_output(
        self,
        num_scheduled_tokens: dict[str, int],
        new_reqs: list[Request],
        resumed_reqs: list[Request],
        new_block_ids: dict[str, list[int]],
    ) -> SchedulerOutput:
        get_block_ids = self.kv_cache_manager.get_block_ids
        scheduled_new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                sampling_params=r.sampling_params,
                block_ids=get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in new_reqs
        ]
        cached = CachedRequestData()
        cached_reqs = [r for r in self.running if r.request_id in new_block_ids] + resumed_reqs
        for r in cached_reqs:
            is_resumed = r.request_id not in new_block_ids
            cached.req_ids.append(r.request_id)
            cached.resumed_from_preemption.append(is_resumed)
            cached.new_block_ids.append(
                get_block_ids(r.request_id) if is_resumed else new_block_ids[r.request_id]
            )
            cached.num_computed_tokens.append(r.num_computed_tokens)
        return SchedulerOutput(
            scheduled_new_reqs=scheduled_new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=self.preempted_req_ids,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, take back rejected drafts, advance grammars and apply
        token-level stops to each new token in turn, keep the next drafts, free finished
        requests.

        A token its grammar refuses (the runner's bitmask allows none) ends that request
        alone, aborted with an error, its tokens from that one on dropped."""
        outputs = []
        scheduled_spec = scheduler_output.scheduled_spec_decode_tokens
        for i, req_id in enumerate(runner_output.req_ids):
            request = self.requests.get(req_id)
            new_token_ids = runner_output.sampled_token_ids[i]
            if request is None or not new_token_ids:
                # Aborted during the step, or a prefill chunk that samples nothing (prompt
                # logprobs come with the first token: the step that completes the prompt).
                continue
            if req_id in scheduled_spec:
                num_draft_tokens = len(scheduled_spec[req_id])
                request.num_computed_tokens -= num_draft_tokens + 1 - len(new_token_ids)
                self._record_acceptance(num_draft_tokens, len(new_token_ids) - 1)
            error = None
            for num_new, token_id in enumerate(new_token_ids, start=1):
                if request.grammar is not None and not request.grammar.accept_token(token_id):
                    error = f"structured_outputs: the grammar refused sampled token {token_id}"
                    request.status = RequestStatus.FINISHED_ABORTED
                    new_token_ids = new_token_ids[: num_new - 1]
                    break
                request.append_output_token_ids([token_id])
                self._check_stop(request)
                if request.is_finished():  # tokens past a stop are dropped
                    new_token_ids = new_token_ids[:num_new]
                    break
            if runner_output.spec_token_ids and not request.is_finished():
                drafts = runner_output.spec_token_ids[i][: self._max_drafts(request)]
                if request.grammar is not None:
                    drafts = request.grammar.validate_tokens(drafts)
                request.spec_token_ids = drafts
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=runner_output.logprobs[i][: len(new_token_ids)],
                    prompt_logprobs=runner_output.prompt_logprobs.get(req_id),
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    error=error,
                )
            )
            if request.is_finished():
                self._free_request(request)
        return outputs

    def _record_acceptance(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    def _max_drafts(self, request: Request) -> int:
        """Drafts worth verifying: a step adds the accepted ones plus one token, so at most
        one less than the tokens `max_tokens` and max_model_len leave."""
        room = self.config.max_model_len - request.num_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens)
        return max(0, room - 1)

    def _check_stop(self, request: Request) -> None:
        params = request.sampling_params
        last_token_id = request.output_token_ids[-1]
        if request.grammar is not None and request.grammar.is_terminated():
            # It took EOS where its text is complete (ignore_eos or min_tokens let it pass
            # the check below): the grammar allows nothing more.
            request.status = RequestStatus.FINISHED_STOPPED
            return
        if request.num_output_tokens >= params.min_tokens:
            if last_token_id == request.eos_token_id and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if last_token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last_token_id
                return
        max_tokens = params.max_tokens
        if (max_tokens is not None and request.num_output_tokens >= max_tokens) or (
            request.num_tokens >= self.config.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED

    def finish_requests(
        self,
        request_ids: Iterable[str],
        finished_status: RequestStatus,
        stop_reason: int | str | None = None,
    ) -> list[str]:
        """Finish live requests from outside a step (abort, stop string), or close waiting
        sessions (abort). Returns those found."""
        found = []
        for req_id in request_ids:
            session = self.kept.get(req_id)
            if session is not None and session.resumable:
                self.kv_cache_manager.free(self.kept.pop(req_id))
                found.append(req_id)
                continue
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            request.stop_reason = stop_reason
            self._free_request(request)
            found.append(req_id)
        return found

    def _free_request(self, request: Request) -> None:
        """A finished request leaves; the runner forgets it. One that ended (not aborted) as
        a session's turn or a beam keeps its blocks in `kept`: a session waits for input there,
        and its next turn is a new request to the runner."""
        if request in self.running:
            self.running.remove(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        self.num_structured_output_reqs -= request.use_structured_output
        aborted = request.status == RequestStatus.FINISHED_ABORTED
        if aborted or not (request.resumable or request.keep_blocks):
            self.kv_cache_manager.free(request)
            return
        if request.resumable:
            request.status = RequestStatus.WAITING_FOR_INPUT
            request.spec_token_ids = []
            request.waiting_since = time.monotonic()
        self.kept[request.request_id] = request  # a beam's until `release_blocks`

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def make_stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        return EngineStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.block_pool.get_usage(),
            num_blocks_in_use=kv.get_num_blocks_in_use(),
            num_tokens_stored=sum(r.num_computed_tokens for r in self.running),
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_prefill_tokens=self.num_prefill_tokens,
            spec_decode_num_drafts=self.num_drafts,
            spec_decode_num_draft_tokens=self.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos),
        )


def _num_common_tokens(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists of one length."""
    if a == b:  # the usual case, at C speed
        return len(a)
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)


def _in_prefill(request: Request) -> bool:
    """Whether a request has more than its next token to compute: a prompt, or a preempted
    request's recompute."""
    return request.num_tokens - request.num_computed_tokens > 1


def _compiling(request: Request) -> bool:
    """Whether a waiting request's grammar is still compiling (it is passed over meanwhile)."""
    return request.status == RequestStatus.WAITING_FOR_FSM and request.grammar is None
