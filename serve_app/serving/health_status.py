"""The engine status `/health` answers from: at most one call into an LLMServer replica per period,
however many probes arrive.

`HealthStatus.current()` returns the latest result (`None`: healthy; else the exception of the
failed check). A result younger than `period_s` is returned as is; an older one is refreshed by
one `check()` call, which concurrent probes share (they all wait for that one call, up to
`timeout_s`, a timeout counting as unhealthy). So a flood of probes costs the replicas at most one
call per `period_s` per ingress replica, and an engine that died is reported by the first probe
after at most `period_s` plus one call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


class HealthStatus:
    def __init__(self, check: Callable[[], Awaitable[object]], period_s: float = 1.0, timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._check = check
        self._period_s = period_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._result: BaseException | None = None
        self._checked_at = float("-inf")
        self._refresh: asyncio.Task | None = None
        self.num_checks = 0

    async def current(self) -> BaseException | None:
        if self._clock() - self._checked_at < self._period_s:
            return self._result
        if self._refresh is None:
            self._refresh = asyncio.ensure_future(self._run_check())
        return await asyncio.shield(self._refresh)

    async def _run_check(self) -> BaseException | None:
        self.num_checks += 1
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._check()
            result = None
        except Exception as exc:  # noqa: BLE001 - any failure means: not healthy
            result = exc
        self._result, self._checked_at, self._refresh = result, self._clock(), None
        return result
