"""EngineWatch: a replica whose engine died leaves the routing at once, by ending its process.

Why exit rather than wait for Serve's health check: between the engine's death and the next health
check (seconds), routers keep choosing the dead replica, and it answers fastest of all (it fails at
once), so it draws most new requests and their retries. A process that exits is seen dead by every
handle on the first call that touches it: Serve's router drops it from its candidates at once
(`on_replica_actor_died`), the caller's retry goes to another replica, and the controller starts a
replacement.

Contract: `under_serve(check_health)` starts the watch in a Serve replica (None elsewhere, e.g. a
replica class used in-process by tests: nothing exits there). Every `period_s` it calls
`check_health`; on the first failure it waits `grace_s` (the in-flight streams' error events go out)
and ends the process. `wait_for_exit()` holds a caller until then (bounded), so that a call that has
sent nothing is failed by the exit (and retried elsewhere) rather than by an error its caller would
retry into this same replica.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

logger = logging.getLogger("ray.serve")

ENGINE_WATCH_PERIOD_S = 0.05
DEAD_EXIT_GRACE_S = 0.5
MAX_HOLD_S = 10.0  # a held call gives up waiting for the exit after this long (should never happen)


def _exit_process() -> None:
    for handler in logging.getLogger().handlers + logger.handlers:
        handler.flush()
    os._exit(1)


class EngineWatch:
    def __init__(self, check_health: Callable[[], None], exit_process: Callable[[], None] = _exit_process,
                 period_s: float = ENGINE_WATCH_PERIOD_S, grace_s: float = DEAD_EXIT_GRACE_S) -> None:
        self._check_health = check_health
        self._exit_process = exit_process
        self.period_s = period_s
        self.grace_s = grace_s
        self.dead: BaseException | None = None
        self._task = asyncio.get_running_loop().create_task(self._run())

    @classmethod
    def under_serve(cls, check_health: Callable[[], None]) -> EngineWatch | None:
        try:
            from ray import serve

            serve.get_replica_context()
        except Exception:  # noqa: BLE001 - not in a Serve replica
            return None
        return cls(check_health)

    async def _run(self) -> None:
        while self.dead is None:
            await asyncio.sleep(self.period_s)
            try:
                self._check_health()
            except Exception as exc:  # noqa: BLE001 - any failure: the engine cannot serve
                self.dead = exc
        logger.error("the engine died (%s): this replica leaves the routing; its process exits in %.1f s and "
                     "Serve starts a replacement", self.dead, self.grace_s)
        await asyncio.sleep(self.grace_s)
        self._exit_process()

    async def wait_for_exit(self) -> None:
        """Hold the caller until the process exits (at most `MAX_HOLD_S`)."""
        await asyncio.wait([self._task], timeout=MAX_HOLD_S)

    def stop(self) -> None:
        self._task.cancel()
