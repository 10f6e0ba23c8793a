"""Starting the tests' local Ray: `ray.init` given a second chance when its node is slow to register.

`ray.init` gives a new local node a fixed 30 s to register with the GCS and raises
"The current node timed out during startup" otherwise. On a loaded 2-core machine (a CI box right
after installing, another test's processes still exiting) that bound is occasionally missed, and a
session-scoped fixture that fails once fails every test that uses it. Start-up time is not what
those tests test, so the start is tried again, after killing what the failed attempt left running.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psutil

STARTUP_TIMEOUT = "timed out during startup"


def init_local_ray(attempts: int = 2, **init_kwargs: Any) -> None:
    """`ray.init(**init_kwargs)` for a new local node, tried up to `attempts` times when (and only
    when) the node does not register in time. Processes a failed attempt spawned (GCS, raylet,
    agents: children of this process that did not exist before it) are killed before the next one.
    Any other error, and the last timeout, are raised."""
    import ray

    for attempt in range(1, attempts + 1):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            ray.init(**init_kwargs)
            return
        except Exception as exc:
            if STARTUP_TIMEOUT not in str(exc) or attempt == attempts:
                raise
            print(f"ray.init: the local node did not register in time (attempt {attempt}); starting again")
            with contextlib.suppress(Exception):
                ray.shutdown()
            _kill_new_children(before)


def _kill_new_children(before: set[int]) -> None:
    spawned = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for proc in spawned:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(spawned, timeout=10)
