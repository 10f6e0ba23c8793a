"""Iteration-level scheduler: decides who runs in each step and how many tokens each computes.

Each step: running requests first (decodes and unfinished prompt chunks, in arrival order), then
waiting requests in FCFS order, within `max_num_seqs` sequences and `max_num_batched_tokens` tokens.
A prompt longer than the remaining budget is split across steps (chunked prefill) and shares its
steps with other requests' decodes. When the KV cache runs out, the newest running request is
preempted: its blocks are freed and it waits at the head of the queue to be recomputed (its output
so far is kept, so it resumes where it was).

The batching policy only changes admission from the waiting queue (see `SchedulerConfig`).
The scheduler never touches tensors.

Speculative decoding (with a `Speculator`): once the step is scheduled, the token budget left over
goes to proposed tokens for decoding requests (never at the expense of a scheduled request: proposed
tokens get blocks only when they are free, and never preempt anyone). After the step, a verified
request keeps the tokens the model runner accepted; the slots of the rejected ones are rolled back
(its computed-token count drops back to its tokens minus one, and blocks past them are released),
so only accepted tokens ever reach the prefix cache.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from serve_app.engine.block_manager import BlockManager
from serve_app.engine.config import SchedulerConfig
from serve_app.engine.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from serve_app.engine.request import Request, RequestStatus
from serve_app.engine.sampler import ACCEPT_DRAW, draw_key
from serve_app.engine.spec_decode.proposer import Proposal, SpecCandidate
from serve_app.engine.spec_decode.speculator import Speculator
from serve_app.metrics.stats import SchedulerStats
from serve_app.types import FinishReason, RequestMetrics


def next_chunk(request: Request, num_computed: int) -> int:
    """The most tokens the request's next chunk may read after `num_computed`: the rest of it, but a
    chunk of prompt tokens stops at the prompt's end (a recompute after preemption reads its prompt,
    then its generated tokens, as decode rows: each position is computed as it was the first time)."""
    if num_computed < request.num_prompt_tokens:
        return request.num_prompt_tokens - num_computed
    return request.num_tokens - num_computed


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        speculator: Speculator | None = None,
    ) -> None:
        self.config = config
        self.speculator = speculator
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # static/dynamic: members of the batch in flight; admission is closed to everyone else
        self._batch_ids: set[str] = set()
        # continuous with waiting_served_ratio: steps the queue head has been held back from running ones
        self._held_steps = 0
        # tokens per request of the step being run (scheduled, not yet through the model): still unread
        self._in_flight: dict[str, int] = {}
        self._step_preempted = 0
        self._step_prefix_queries = 0
        self._step_prefix_hits = 0
        self._step_spec = [0, 0, 0, 0]  # candidates, verified requests, proposed, accepted

    # ---- queue management ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason = FinishReason.ABORT) -> list[EngineCoreOutput]:
        """Finish the given requests now (unknown ids are ignored) and free their blocks at once."""
        outputs = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            outputs.append(EngineCoreOutput(rid, (), reason, metrics=self._finish(request, reason)))
        return outputs

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_pending_prompt_tokens(self) -> int:
        """Tokens still to be read before each request's next new token, beyond the one a decode step
        reads: whole prompts of waiting requests, the rest of part-read ones (including the chunk the
        step being run reads), a preempted request's recompute. Safe to call from another thread while
        a step runs (the queues are copied first, atomically under the GIL)."""
        in_flight = self._in_flight
        total = 0
        for r in (*tuple(self.waiting), *list(self.running)):
            read = r.num_computed_tokens - in_flight.get(r.request_id, 0)
            total += max(0, r.num_tokens - read - (1 if r.num_output_tokens else 0))
        return total

    def _blocks_being_computed(self, picked: list[tuple[Request, int]]) -> set:
        """Hashes of the prompt blocks the requests picked so far have yet to compute."""
        computing: set = set()
        for request, _ in picked:
            if request.num_computed_tokens < request.num_prompt_tokens:
                computing.update(self.block_manager.uncomputed_prompt_hashes(request))
        return computing

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        picked: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = next_chunk(request, request.num_computed_tokens)
            if not chunked and num_new > budget:
                i += 1
                continue
            num_new = min(num_new, budget)
            while not self.block_manager.allocate_slots(request, num_new):
                victim = self.running.pop()  # newest first; never one already picked (they sit before i)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break
            picked.append((request, num_new))
            budget -= num_new
            i += 1

        if not preempted and self._admitting():
            self._open_batch(now)
            # prompt blocks the batch is computing: a waiting request whose next uncached block is one
            # of them waits a step and then reads it from the cache instead of computing it again
            # (requests sharing a new prefix that arrive together); continuous batching only, where
            # order within the queue is not what batches are made of
            computing = (self._blocks_being_computed(picked)
                         if self.waiting and self.config.batching == "continuous" else None)
            deferred: list[Request] = []
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                if self.config.batching != "continuous" and request.request_id not in self._batch_ids:
                    break
                if request.grammar is not None and not request.grammar.ready:  # still compiling: not in the batch
                    deferred.append(self.waiting.popleft())
                    continue
                cached = self.block_manager.find_cached_prefix(request)
                if computing and self.block_manager.next_uncached_hash(request, len(cached)) in computing:
                    deferred.append(self.waiting.popleft())
                    continue
                num_cached = len(cached) * self.block_manager.block_size
                num_new = next_chunk(request, num_cached)
                if not chunked and num_new > budget:
                    break
                num_new = min(num_new, budget)
                if not self.block_manager.allocate_slots(request, num_new, cached):
                    break
                self.waiting.popleft()
                if computing is not None:
                    computing.update(self.block_manager.uncomputed_prompt_hashes(request))
                self.running.append(request)
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_cached
                self._step_prefix_queries += request.num_tokens
                self._step_prefix_hits += num_cached
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = now
                    request.num_cached_tokens = num_cached
                picked.append((request, num_new))
                budget -= num_new

            self.waiting.extendleft(reversed(deferred))  # back at the head, in their order

        spec = self._plan_speculation(picked, budget) if self.speculator is not None and budget > 0 else {}
        budget -= sum(len(p.token_ids) for p in spec.values())
        scheduled = tuple(self._to_scheduled(request, num_new, spec.get(request.request_id)) for request, num_new in picked)
        self._in_flight = {s.request_id: s.num_tokens for s in scheduled}
        for request, sched in zip((r for r, _ in picked), scheduled, strict=True):
            request.num_computed_tokens += sched.num_tokens
        self._step_preempted += len(preempted)
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_ids=tuple(r.request_id for r in preempted),
        )

    def _admitting(self) -> bool:
        """Whether waiting requests may join this step (with `waiting_served_ratio`: not while too few of them wait)."""
        ratio = self.config.waiting_served_ratio
        if (not ratio or not self.waiting or not self.running or self._held_steps >= self.config.max_waiting_steps
                or len(self.waiting) >= ratio * len(self.running)):
            self._held_steps = 0
            return True
        self._held_steps += 1
        return False

    def _open_batch(self, now: float) -> None:
        """static/dynamic: when the previous batch has drained, choose the next one from the queue head."""
        if self.config.batching == "continuous" or self._batch_ids or not self.waiting:
            return
        full = len(self.waiting) >= self.config.batch_size
        if full or now - self.waiting[0].arrival_time >= self.config.batch_timeout_s:
            self._batch_ids = {r.request_id for _, r in zip(range(self.config.batch_size), self.waiting, strict=False)}

    def next_wakeup_s(self) -> float | None:
        """Seconds until a waiting batch's timeout opens it (static/dynamic); None if not waiting for one."""
        if self.config.batching == "continuous" or self._batch_ids or not self.waiting or self.running:
            return None
        return max(0.0, self.waiting[0].arrival_time + self.config.batch_timeout_s - self.clock())

    def _plan_speculation(self, picked: list[tuple[Request, int]], budget: int) -> dict[str, Proposal]:
        """Proposed tokens for the step's decoding requests, with their blocks allocated."""
        candidates = []
        for request, num_new in picked:
            # (a prompt's last token is read as a prompt token, never as a verification row)
            if (num_new != 1 or request.num_tokens - request.num_computed_tokens != 1 or not request.sampling_params.can_speculate
                    or request.num_computed_tokens < request.num_prompt_tokens):
                continue
            # a proposal past max_tokens or the context length could never be used
            max_k = min(request.sampling_params.max_tokens - request.num_output_tokens - 1, self.max_model_len - request.num_tokens)
            candidates.append(SpecCandidate(request.request_id, request.all_token_ids, max_k, request.sampling_params,
                                            request.num_output_tokens))
        if not candidates:
            return {}
        num_prefill = sum(n for r, n in picked if r.num_computed_tokens < r.num_prompt_tokens)
        num_tokens = sum(n for _, n in picked)
        num_sampling = sum(1 for r, n in picked if r.num_computed_tokens + n == r.num_tokens)
        plan = self.speculator.plan(candidates, num_prefill, num_tokens - num_prefill, num_sampling, budget)
        for rid, proposal in list(plan.items()):
            if not self.block_manager.allocate_slots(self.requests[rid], 1 + len(proposal.token_ids)):
                del plan[rid]  # no free blocks: verify nothing rather than preempt anyone for a guess
        self._step_spec[0] += len(candidates)
        self._step_spec[1] += len(plan)
        self._step_spec[2] += sum(len(p.token_ids) for p in plan.values())
        return plan

    def _to_scheduled(self, request: Request, num_new: int, proposal: Proposal | None = None) -> ScheduledRequest:
        spec_token_ids = proposal.token_ids if proposal is not None else ()
        start = request.num_computed_tokens
        sample = start + num_new == request.num_tokens
        params = request.sampling_params
        seed = params.seed
        penalties = sample and params.has_penalties
        blocked: tuple[int, ...] = ()
        if sample and request.num_output_tokens < params.min_tokens:
            blocked = tuple(sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else request.eos_token_ids)))
        keys = [None if seed is None else draw_key(seed, request.num_output_tokens + j) for j in range(1 + len(spec_token_ids))]
        draft_probs = proposal.draft_probs if proposal is not None else None
        accept_keys = () if draft_probs is None else tuple(
            None if seed is None else draw_key(seed, request.num_output_tokens + j, ACCEPT_DRAW) for j in range(len(spec_token_ids)))
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=tuple(request.all_token_ids[start : start + num_new]) + spec_token_ids,
            start_pos=start,
            block_table=tuple(self.block_manager.block_table(request.request_id)),
            sample=sample,
            reads_prompt=start < request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            generator_key=keys[0],
            prompt_token_ids=tuple(request.prompt_token_ids) if penalties else (),
            output_token_ids=tuple(request.output_token_ids) if penalties else (),
            blocked_token_ids=blocked,
            spec_token_ids=spec_token_ids,
            spec_generator_keys=tuple(keys[1:]),
            spec_draft_probs=draft_probs,
            spec_accept_keys=accept_keys,
            grammar=request.grammar if sample else None,
        )

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- results -------------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled (and accepted) tokens, apply stop conditions, roll back rejected proposed
        tokens, free finished requests."""
        now = self.clock()
        self._in_flight = {}
        num_spec = {s.request_id: len(s.spec_token_ids) for s in scheduler_output.scheduled if s.spec_token_ids}
        extras = runner_output.extra_token_ids or ((),) * len(runner_output.request_ids)
        appended = []
        for request_id, token_id, extra in zip(runner_output.request_ids, runner_output.sampled_token_ids, extras, strict=True):
            request = self.requests.get(request_id)
            if request is None:  # aborted while the step ran
                continue
            new_tokens, reason, stop_token = self._append(request, (token_id, *extra))
            if request.first_token_time is None:
                request.first_token_time = now
            if request_id in num_spec:
                self.speculator.observe(request_id, num_spec[request_id], len(extra))
                self._step_spec[3] += len(extra)
                # rejected tokens' KV is garbage: the request has computed all but its newest token
                request.num_computed_tokens = request.num_tokens - 1
                self.block_manager.trim(request_id, request.num_computed_tokens)
            appended.append((request, new_tokens, reason, stop_token))
        for sched in scheduler_output.scheduled:  # before finishing frees them: full blocks stay reusable
            request = self.requests.get(sched.request_id)
            if request is not None:
                self.block_manager.cache_full_blocks(request)
        outputs = []
        logprobs = runner_output.logprobs or (None,) * len(runner_output.request_ids)
        by_id = dict(zip(runner_output.request_ids, logprobs, strict=True))
        for request, new_tokens, reason, stop_token in appended:
            metrics = None
            if reason is not None:
                self.running.remove(request)
                metrics = self._finish(request, reason, now)
            token_logprobs = by_id.get(request.request_id)
            new_logprobs = None if token_logprobs is None else (token_logprobs,)
            outputs.append(EngineCoreOutput(request.request_id, new_tokens, reason, stop_token, metrics, new_logprobs))
        return outputs

    def _append(self, request: Request, token_ids: tuple[int, ...]) -> tuple[tuple[int, ...], FinishReason | None, int | None]:
        """Append tokens one by one, stopping (and dropping the rest) at the first stop condition."""
        for i, token_id in enumerate(token_ids):
            request.append_output_token(token_id)
            if request.grammar is not None and not request.grammar.accept(token_id):
                # the mask allowed it, so the matcher disagrees with itself: end the request rather than
                # let it go on unconstrained
                return token_ids[: i + 1], FinishReason.ABORT, None
            reason, stop_token = self._check_stop(request, token_id)
            if reason is not None:
                return token_ids[: i + 1], reason, stop_token
        return token_ids, None, None

    def _check_stop(self, request: Request, token_id: int) -> tuple[FinishReason | None, int | None]:
        params = request.sampling_params
        if token_id in request.eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP, None
        if request.grammar is not None and request.grammar.terminated:  # its grammar ended (on EOS, even with ignore_eos)
            return FinishReason.STOP, None
        if token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _finish(self, request: Request, reason: FinishReason, now: float | None = None) -> RequestMetrics:
        now = self.clock() if now is None else now
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = now
        self.block_manager.free(request.request_id)
        del self.requests[request.request_id]
        self._batch_ids.discard(request.request_id)
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        return RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finished_time=now,
            num_prompt_tokens=request.num_prompt_tokens,
            num_generation_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions,
        )

    # ---- stats ---------------------------------------------------------------------------------
    def make_stats(self, step_index: int, start: float, duration_s: float, output: SchedulerOutput) -> SchedulerStats:
        """Stats of the step just run; resets the per-step counters."""
        bm = self.block_manager
        batch = tuple((s.request_id, s.num_tokens, s.reads_prompt) for s in output.scheduled)
        prefill = sum(n for _, n, is_prefill in batch if is_prefill)
        stats = SchedulerStats(
            step_index=step_index,
            step_start_time=start,
            step_duration_s=duration_s,
            num_scheduled_seqs=len(output.scheduled),
            num_prefill_tokens=prefill,
            num_decode_tokens=output.num_batched_tokens - prefill,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preempted=self._step_preempted,
            kv_cache_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            prefix_cache_queries=self._step_prefix_queries,
            prefix_cache_hits=self._step_prefix_hits,
            batch=batch,
            spec_num_candidates=self._step_spec[0],
            spec_num_seqs=self._step_spec[1],
            spec_num_proposed=self._step_spec[2],
            spec_num_accepted=self._step_spec[3],
        )
        self._step_preempted = self._step_prefix_queries = self._step_prefix_hits = 0
        self._step_spec = [0, 0, 0, 0]
        return stats
