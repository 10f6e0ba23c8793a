"""The `Backend` interface: what an LLMServer replica needs from an inference engine.

One backend instance lives in one replica and serves many concurrent requests from that replica's
event loop. Implementations: `native` (this repository's engine); others (vLLM) plug in the same way.

Contracts:
- `options_from_kwargs(model, engine)` (a classmethod) validates a serving config's `engine` mapping
  into the backend's options, raising `ValueError` naming the option; it runs once, where the config
  is loaded, and imports no engine. `from_config(config, stat_loggers, fault_hook)` builds the
  backend in its replica from that `config.BackendConfig` (its `options` already validated).
- `start()` is awaited once before anything else; it loads the model and may take seconds.
- `generate(request)` is an async iterator of `RequestOutput` *deltas* (text and token ids new since
  the previous item), ending with one whose `finished` is True. Invalid input raises `ValueError`
  whose message starts with the field name ("prompt: ...", "max_tokens: ...") from the first
  iteration, before anything is queued. The first item is an empty delta (no tokens, not finished)
  that confirms the request was queued, before its first token; the ingress then sends a stream's
  headers (and keep-alive comments while it waits) without waiting for the first token. Leaving
  the iteration early (`aclose()`, task cancellation) aborts the request and frees its KV cache.
- `abort(request_id)` returns once the request's resources are free (no-op for unknown ids).
- `routing_stats()` is cheap and non-blocking (called every routing-stats period).
- `prefix_cache_update()` (optional) is the incremental view of what the prefix cache holds
  (`serve_app.engine.kv_events`), merged into the routing stats at each poll; {} when not tracked.
- `check_health()` raises when the backend can no longer serve (e.g. its engine loop died), so that
  Ray Serve replaces the replica.
- `seconds_without_progress()`: how long the engine has had work without finishing a step (0 when
  idle); the replica's health check fails when it passes a bound (a hung step).
- `shutdown()` releases the engine; idempotent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from serve_app.generation_config import GenerationDefaults
from serve_app.types import GenerateRequest, RequestOutput

if TYPE_CHECKING:
    from serve_app.backends.config import BackendConfig


@dataclass(frozen=True)
class RoutingStats:
    """A replica's load as published to request routers (`record_routing_stats`)."""

    kv_cache_usage: float  # used / total KV blocks, 0-1
    num_free_blocks: int
    num_total_blocks: int
    num_waiting: int
    num_running: int
    num_pending_prompt_tokens: int = 0  # prompt tokens queued for prefill (EngineLoad)
    # the replica's own step-cost fit (serve_app.engine.step_cost), 0 until it has one: routers
    # predict time to first token in seconds with it
    step_fixed_s: float = 0.0
    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_load(cls, load: Any) -> RoutingStats:
        """From an `EngineLoad`-like snapshot (serve_app/metrics/stats.py), whichever engine made it."""
        return cls(
            kv_cache_usage=float(load.kv_cache_usage),
            num_free_blocks=int(load.num_free_blocks),
            num_total_blocks=int(load.num_total_blocks),
            num_waiting=int(load.num_waiting),
            num_running=int(load.num_running),
            num_pending_prompt_tokens=int(load.num_pending_prompt_tokens),
        )


@dataclass(frozen=True)
class ModelInfo:
    """What the API layer needs to know about the served model."""

    name: str
    max_model_len: int
    backend: str
    generation_defaults: GenerationDefaults = GenerationDefaults()  # EOS ids, sampling defaults of the checkpoint
    # the class of the tokenizer the engine loaded ("module.ClassName"; None: none, or not known):
    # the ingress loads the same one without resolving it itself (serve_app.input_processor)
    tokenizer_class: str | None = None
    chat_template_tools: bool = False  # the chat template renders `tools` itself (serving/tool_prompt.py)


class BackendDeadError(RuntimeError):
    """The backend cannot serve any more requests; the replica must be replaced."""


class Backend(ABC):
    @classmethod
    @abstractmethod
    def options_from_kwargs(cls, model: str, engine: dict[str, Any]) -> Any:
        """The backend's options from a serving config's `engine` mapping (see the module docstring)."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: BackendConfig, stat_loggers: Sequence[Any] = (), fault_hook: Any = None) -> Backend:
        """The backend of `config` (not started yet). `fault_hook` (tests only, serve_app/faults.py)
        reaches the native engine's per-request stages; other backends ignore it."""

    @abstractmethod
    async def start(self) -> None:
        """Load the model and start the engine."""

    @abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream `RequestOutput` deltas for one request (see the module docstring)."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once its resources are free."""

    @abstractmethod
    def routing_stats(self) -> RoutingStats:
        """Current load, cheap enough to call every fraction of a second."""

    def prefix_cache_update(self) -> dict[str, Any]:
        """What changed in the prefix cache since earlier polls (see the module docstring)."""
        return {}

    @abstractmethod
    def model_info(self) -> ModelInfo:
        """Served model name and context length (valid after `start`)."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise (preferably `BackendDeadError`) if the backend cannot serve."""

    def seconds_without_progress(self) -> float:
        """Seconds the engine has had work pending without finishing a step; 0 while idle."""
        return 0.0

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and release its memory; safe to call twice."""
