"""The native backend: this repository's engine behind the `Backend` interface.

The engine steps in a thread of the replica (`AsyncLLMEngine`) or, with the engine option
`core_process`, in a process of its own (`ProcessLLMEngine`); both have one front end. torch and the
engine are imported in `start()`, inside the replica, so that importing this module (and the serving
layer above it) never loads torch; with `core_process` the replica never loads it at all.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from serve_app.backends.base import Backend, BackendDeadError, ModelInfo, RoutingStats
from serve_app.engine.config import EngineConfig
from serve_app.engine.request_streams import EngineDeadError
from serve_app.types import GenerateRequest, RequestOutput

if TYPE_CHECKING:
    from serve_app.backends.config import BackendConfig
    from serve_app.engine.async_engine import AsyncLLMEngine
    from serve_app.engine.process_engine import ProcessLLMEngine

logger = logging.getLogger(__name__)


class NativeBackend(Backend):
    """Wraps one `AsyncLLMEngine` or `ProcessLLMEngine`.

    `stat_loggers` are passed through to the engine unchanged: each receives every step's
    `SchedulerStats` and every finished request's metrics (the metrics exporters plug in here).
    """

    def __init__(self, engine_config: EngineConfig, model_name: str = "", stat_loggers: Sequence[Any] = (),
                 fault_hook: Any = None) -> None:
        self.engine_config = engine_config
        self.model_name = model_name or engine_config.model.name
        self.stat_loggers = tuple(stat_loggers)
        self.fault_hook = fault_hook  # tests only (serve_app/faults.py)
        self._engine: AsyncLLMEngine | ProcessLLMEngine | None = None
        self._closed = False
        self._publisher = None

    @property
    def engine(self) -> AsyncLLMEngine | ProcessLLMEngine:
        if self._engine is None:
            raise BackendDeadError("backend not started" if not self._closed else "backend shut down")
        return self._engine

    async def start(self) -> None:
        if self._engine is not None:
            return
        from serve_app.engine.kv_events import KVCachePublisher

        if self.engine_config.core_process:
            from serve_app.engine.process_engine import ProcessLLMEngine as Engine
        else:
            from serve_app.engine.async_engine import AsyncLLMEngine as Engine
        self._engine = Engine(self.engine_config, self.stat_loggers, self.fault_hook)
        self._publisher = KVCachePublisher(self._engine.kv_events, self.engine_config.cache.block_size)
        load = self._engine.load()
        logger.info(
            "native engine ready: model %s, %s on %s, context %d tokens, %d KV blocks, stepping in %s",
            self.model_name, self.engine_config.model.dtype, self.engine_config.model.device,
            self._engine.max_model_len, load.num_total_blocks,
            "a process of its own" if self.engine_config.core_process else "a thread of the replica",
        )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        stream = self.engine.generate(request, announce=True)
        try:
            async for output in stream:
                yield output
        except EngineDeadError as exc:
            raise BackendDeadError(str(exc)) from exc
        finally:
            await stream.aclose()  # aborts the request in the engine if it has not finished

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def routing_stats(self) -> RoutingStats:
        stats = RoutingStats.from_load(self.engine.load())
        cost = self.engine.step_cost()
        if cost is None:
            return stats
        return dataclasses.replace(stats, step_fixed_s=cost.fixed_s, prefill_s_per_token=cost.per_prefill_token_s,
                                   decode_s_per_token=cost.per_decode_token_s)

    def prefix_cache_update(self) -> dict[str, Any]:
        return {} if self._publisher is None or self._engine is None else self._publisher.next_update()

    @classmethod
    def options_from_kwargs(cls, model: str, engine: dict[str, Any]) -> EngineConfig:
        """`engine` holds `EngineConfig.from_kwargs` names (`dtype`, `max_num_seqs`, `speculative`, ...)."""
        return EngineConfig.from_kwargs(model, **engine)

    @classmethod
    def from_config(cls, config: BackendConfig, stat_loggers: Sequence[Any] = (), fault_hook: Any = None) -> NativeBackend:
        return cls(config.options, config.model_name, stat_loggers, fault_hook)

    def model_info(self) -> ModelInfo:
        inputs = self.engine.input_processor
        return ModelInfo(name=self.model_name, max_model_len=self.engine.max_model_len, backend="native",
                         generation_defaults=inputs.generation_defaults, tokenizer_class=inputs.tokenizer_class,
                         chat_template_tools=inputs.chat_template_tools)

    def check_health(self) -> None:
        try:
            self.engine.check_health()
        except EngineDeadError as exc:
            raise BackendDeadError(str(exc)) from exc

    def seconds_without_progress(self) -> float:
        return self.engine.seconds_without_progress()

    def shutdown(self) -> None:
        engine, self._engine, self._closed = self._engine, None, True
        if engine is not None:
            engine.shutdown()
