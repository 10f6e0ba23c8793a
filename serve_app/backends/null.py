"""The null backend (`backend: null`): generates tokens with no model, to measure what a deployment's serving
path (proxy, ingress, router, replica shim, Ray) carries and costs on its own, and to run the serving stack
where no model should load; `model` still names a model directory (its tokenizer and `config.json`), and
`engine` holds `NullEngineOptions` (docs/serving-path.md#the-null-backend).

Real: request validation and tokenization (the model's tokenizer through the engine's `InputProcessor`), the
output tokens and their text (a real passage, each request from its own offset, detokenized per token),
continuous-batching admission (`max_num_seqs`, KV blocks counted per request), the step clock (a token per
running request every `step_time_s`), `SchedulerStats` and `RequestMetrics` to the stat loggers, routing
stats, aborts freeing blocks, and the hand-off to the replica's event loop (one `call_soon_threadsafe` per
step, as a GPU engine would). Not real: sampling (every request runs to `max_tokens`), prefill cost (a prompt
takes one step) and preemption (a request that finds no free block ends with "length"). The engine thread
is named `null-engine` at the OS level, so a benchmark can count its CPU apart (loadtest/serving_path.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from serve_app.backends.base import Backend, BackendDeadError, ModelInfo, RoutingStats
from serve_app.backends.config import BackendConfig
from serve_app.metrics.stats import SchedulerStats
from serve_app.types import FinishReason, GenerateRequest, RequestMetrics, RequestOutput

ENGINE_THREAD_NAME = "null-engine"
# what the "model" says: ordinary prose, so token lengths and text are those of real output
PASSAGE = (
    "The river rose slowly through the night, and by morning the low fields along the valley were under a "
    "shallow sheet of brown water. Farmers moved their animals to the higher pastures, while the children "
    "watched from the bridge as branches, fence posts and the occasional lost boot drifted past. In the town, "
    "the baker kept his ovens burning, because people still needed bread, and the schoolteacher opened the hall "
    "so that families from the lower streets had somewhere dry to sleep. Nobody could remember a flood like it, "
    "although the oldest residents insisted that their grandparents had told stories of worse. By the third "
    "day the water began to fall, leaving behind a fine grey silt that covered everything it had touched. "
)


@dataclass(frozen=True)
class NullEngineOptions:
    """`engine` options of the null backend (validated once; a bad value raises ValueError naming it)."""

    step_time_s: float = 0.02  # one decode step (every running request gets one token)
    max_num_seqs: int = 256  # requests running at once; the rest wait
    num_blocks: int = 16384  # KV blocks of the pretend cache (admission and routing stats)
    block_size: int = 16
    max_model_len: int = 8192
    device: str = "none"  # no torch, no device: the replica leaves its thread settings alone

    def __post_init__(self) -> None:
        if not 0 < self.step_time_s <= 10:
            raise ValueError(f"step_time_s: must be in (0, 10] seconds, got {self.step_time_s!r}")
        for name in ("max_num_seqs", "num_blocks", "block_size", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.device != "none":
            raise ValueError(f"device: the null engine runs on no device ('none'), got {self.device!r}")

    @property
    def kv_block_size(self) -> int:  # the backend options contract (serve_app.backends.config.BackendConfig)
        return self.block_size

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> NullEngineOptions:
        known = {f.name for f in fields(cls)}
        for name in kwargs:
            if name not in known:
                raise ValueError(f"{name}: not a null-engine option (known: {', '.join(sorted(known))})")
        return cls(**kwargs)


@dataclass
class _Sequence:
    """One request inside the null engine (engine thread only)."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    offset: int  # where in the passage its output starts
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_generated: int = 0
    num_blocks: int = 0


class NullEngine:
    """The step loop on its own thread; outputs go to each request's asyncio queue on `loop`."""

    def __init__(self, options: NullEngineOptions, token_ids: list[int], token_texts: dict[int, str],
                 stat_loggers: Sequence[Any], loop: asyncio.AbstractEventLoop) -> None:
        self.options, self._token_ids, self._texts, self._stat_loggers, self._loop = options, token_ids, token_texts, tuple(stat_loggers), loop
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}  # event-loop side
        self._waiting: list[_Sequence] = []
        self._running: dict[str, _Sequence] = {}
        self._num_free_blocks, self._step_index, self._stopped = options.num_blocks, 0, threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD_NAME, daemon=True)
        self._thread.start()

    # ---- event-loop side -------------------------------------------------------------------------
    def add(self, seq: _Sequence) -> asyncio.Queue:
        out: asyncio.Queue = asyncio.Queue()
        self._queues[seq.request_id] = out
        self._inbox.put(("add", seq))
        return out

    def abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None:
            self._inbox.put(("abort", request_id))

    def finish(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def load(self) -> RoutingStats:
        total, free = self.options.num_blocks, self._num_free_blocks
        return RoutingStats(kv_cache_usage=1 - free / total, num_free_blocks=free, num_total_blocks=total,
                            num_waiting=len(self._waiting), num_running=len(self._running))

    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def stop(self) -> None:
        self._stopped.set()
        self._inbox.put(("stop", None))
        self._thread.join(timeout=10)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        for q in self._queues.values():
            q.put_nowait(exc)

    # ---- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        _name_os_thread(ENGINE_THREAD_NAME)
        next_step = time.monotonic()
        try:
            while not self._stopped.is_set():
                idle = not self._running and not self._waiting
                if not self._drain_inbox(block=idle):
                    break
                if idle:
                    next_step = time.monotonic()  # a new request starts a step at once
                self._admit()
                if not self._running:
                    continue
                next_step += self.options.step_time_s
                delay = next_step - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                else:  # behind (a starved machine): run late steps back to back, never in bursts
                    next_step = time.monotonic()
                self._step()
        except BaseException as exc:  # noqa: BLE001 - every caller must hear of it
            self.error = exc
            self._loop.call_soon_threadsafe(self._fail_all, BackendDeadError(f"null engine died: {exc!r}"))

    def _drain_inbox(self, block: bool) -> bool:
        while True:
            try:
                kind, payload = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self._waiting.append(payload)
            else:
                self._drop(payload)

    def _drop(self, request_id: str) -> None:
        self._waiting = [s for s in self._waiting if s.request_id != request_id]
        seq = self._running.pop(request_id, None)
        if seq is not None:
            self._num_free_blocks += seq.num_blocks
            self._record(None, [(FinishReason.ABORT, self._metrics(seq, time.monotonic()))])

    def _blocks(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.options.block_size)

    def _admit(self) -> None:
        now = time.monotonic()
        while self._waiting and len(self._running) < self.options.max_num_seqs:
            seq = self._waiting[0]
            need = self._blocks(seq.num_prompt_tokens + 1)
            if need > self._num_free_blocks:
                break
            self._waiting.pop(0)
            seq.first_scheduled_time, seq.num_blocks = now, need
            self._num_free_blocks -= need
            self._running[seq.request_id] = seq

    def _step(self) -> None:
        start = time.monotonic()
        outputs: list[RequestOutput] = []
        finished: list[tuple[FinishReason, RequestMetrics]] = []
        num_prefill, batch = sum(s.num_prompt_tokens for s in self._running.values() if s.num_generated == 0), len(self._running)
        for seq in list(self._running.values()):
            token_id = self._token_ids[(seq.offset + seq.num_generated) % len(self._token_ids)]
            seq.num_generated += 1
            if seq.first_token_time is None:
                seq.first_token_time = start
            need = self._blocks(seq.num_prompt_tokens + seq.num_generated + 1) - seq.num_blocks
            done = seq.num_generated >= seq.max_tokens or self._num_free_blocks < need
            if not done and need > 0:
                seq.num_blocks += need
                self._num_free_blocks -= need
            reason = FinishReason.LENGTH if done else None
            metrics = self._metrics(seq, start) if done else _NO_METRICS
            outputs.append(RequestOutput(seq.request_id, self._texts[token_id], (token_id,), done, reason,
                                         seq.num_prompt_tokens, metrics))
            if done:
                del self._running[seq.request_id]
                self._num_free_blocks += seq.num_blocks
                finished.append((FinishReason.LENGTH, metrics))
        self._loop.call_soon_threadsafe(self._dispatch, outputs)
        self._step_index += 1
        total = self.options.num_blocks
        stats = SchedulerStats(
            step_index=self._step_index, step_start_time=start, step_duration_s=self.options.step_time_s,
            num_scheduled_seqs=batch, num_prefill_tokens=num_prefill, num_decode_tokens=batch,
            num_running=len(self._running), num_waiting=len(self._waiting), num_preempted=0,
            kv_cache_usage=1 - self._num_free_blocks / total, num_free_blocks=self._num_free_blocks,
            num_total_blocks=total, prefix_cache_queries=0, prefix_cache_hits=0)
        self._record(stats, finished)

    def _metrics(self, seq: _Sequence, now: float) -> RequestMetrics:
        return RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, now,
                              seq.num_prompt_tokens, seq.num_generated)

    def _record(self, stats: SchedulerStats | None, finished: list[tuple[FinishReason, RequestMetrics]]) -> None:
        for stat_logger in self._stat_loggers:
            stat_logger.record(stats, finished)


_NO_METRICS = RequestMetrics(arrival_time=0.0)  # deltas before the last carry no timings


def _name_os_thread(name: str) -> None:
    """Set the calling thread's OS-level name (Linux; /proc/<pid>/task/<tid>/comm), if possible."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


class NullBackend(Backend):
    """The null engine behind the `Backend` interface (see the module docstring)."""

    def __init__(self, model: str, options: NullEngineOptions, model_name: str = "", stat_loggers: Sequence[Any] = ()) -> None:
        self.model, self.options, self.model_name, self.stat_loggers = model, options, model_name or Path(model).name, tuple(stat_loggers)
        self._engine: NullEngine | None = None
        self._input: Any = None
        self._num_requests = 0

    @classmethod
    def options_from_kwargs(cls, model: str, engine: dict[str, Any]) -> NullEngineOptions:
        return NullEngineOptions.from_kwargs(engine)

    @classmethod
    def from_config(cls, config: BackendConfig, stat_loggers: Sequence[Any] = (), fault_hook: Any = None) -> NullBackend:
        return cls(config.model, config.options, config.model_name, stat_loggers)

    async def start(self) -> None:
        if self._engine is not None:
            return
        from serve_app.input_processor import InputProcessor

        vocab_size = json.loads((Path(self.model) / "config.json").read_text())["vocab_size"]
        self._input = InputProcessor(self.model, vocab_size, self.options.max_model_len)
        tokenizer = self._input.tokenizer
        token_ids = tokenizer.encode(PASSAGE, add_special_tokens=False).ids
        texts = {t: tokenizer.decode([t], skip_special_tokens=False) for t in set(token_ids)}
        self._engine = NullEngine(self.options, token_ids, texts, self.stat_loggers, asyncio.get_running_loop())

    @property
    def engine(self) -> NullEngine:
        if self._engine is None:
            raise BackendDeadError("backend not started or shut down")
        return self._engine

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.check_health()
        processed = self._input.process(request)  # ValueError on bad input, before anything is queued
        max_tokens = min(request.sampling_params.max_tokens, self.options.max_model_len - processed.num_prompt_tokens)
        self._num_requests += 1
        seq = _Sequence(request.request_id, processed.num_prompt_tokens, max_tokens,
                        offset=self._num_requests * 7919, arrival_time=request.arrival_time)
        engine = self.engine
        outputs = engine.add(seq)
        finished = False
        try:
            yield RequestOutput.admitted(request.request_id, processed.prompt_token_ids, request.arrival_time)
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if finished:
                engine.finish(seq.request_id)
            else:
                engine.abort(seq.request_id)

    async def abort(self, request_id: str) -> None:
        """Queues the abort; the engine thread frees the request's blocks before its next step."""
        self.engine.abort(request_id)

    def routing_stats(self) -> RoutingStats:
        return self.engine.load()

    def model_info(self) -> ModelInfo:
        tokenizer_class = None if self._input is None else self._input.tokenizer_class  # the ingress loads the same, torch-free
        return ModelInfo(name=self.model_name, max_model_len=self.options.max_model_len, backend="null",
                         tokenizer_class=tokenizer_class)

    def check_health(self) -> None:
        if not self.engine.alive():
            raise BackendDeadError(f"null engine loop stopped: {self.engine.error!r}")

    def shutdown(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.stop()
