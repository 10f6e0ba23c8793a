"""vLLM backend test helpers (tests/vllm, marker `vllm`: `make test-vllm`).

Each test module starts at most one vLLM engine (module-scoped fixture; ≈ 35 s with `enforce_eager`
on 2 cores), never two at once. Modules call `pytest.importorskip("vllm")` first, so without
`make install-vllm` they are skipped, not failed; this file imports nothing from vllm.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

# fp32 (token-exact with HF and the native engine), no torch.compile, a small KV cache and context
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 2048, "kv_cache_memory_gib": 0.25, "max_num_seqs": 16}
KV_BLOCK_SIZE = 128  # vLLM's CPU default
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no network from tests


class EventLoop:
    """One event loop for a module: vLLM's `AsyncLLM` belongs to the loop it was started on."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Awaitable[T], timeout_s: float = 120.0) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout_s))

    def close(self) -> None:
        self.loop.close()


@pytest.fixture(scope="module")
def loop():
    """The module's event loop (its vLLM engine's)."""
    runner = EventLoop()
    yield runner
    runner.close()


async def collect(stream) -> list[Any]:
    return [item async for item in stream]


async def wait_until(predicate: Callable[[], Any], timeout_s: float, message: str) -> Any:
    """Poll `predicate` on the event loop until truthy (returned) or fail after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {message} (last: {value!r})")
        await asyncio.sleep(0.02)


class RecordingLogger:
    """Keeps every call the backend's stats bridge makes (ground truth for the exporter checks)."""

    def __init__(self) -> None:
        self.steps: list[Any] = []
        self.finished: list[Any] = []
        self.loads: list[Any] = []

    def record(self, scheduler_stats, finished) -> None:
        if scheduler_stats is not None:
            self.steps.append(scheduler_stats)
        self.finished.extend(finished)

    def record_load(self, load) -> None:
        self.loads.append(load)
