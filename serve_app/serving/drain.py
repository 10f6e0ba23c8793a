"""Whether Ray Serve has begun shutting this replica down (scale-down, redeploy, `serve delete`).

Serve drains a stopping replica by waiting for its ongoing requests until its force-kill deadline
(`graceful_shutdown_timeout_s`) and only then calls `__del__`; it tells the replica's own code
nothing in between. A replica that must stop long streams cleanly at its own drain deadline needs to
know when the drain began: Serve records it in the replica's `_shutting_down` flag, which this
module reads through the replica context's handle-registration callback (a closure over the
replica). Neither is a public API: if a Serve version changes them, `shutdown_probe()` returns None
and streams still running at Serve's deadline are cut by the kill (their clients get an error event).
"""

from __future__ import annotations

from collections.abc import Callable


def shutdown_probe() -> Callable[[], bool] | None:
    """A cheap function answering "has Serve begun shutting this replica down?", or None when it
    cannot be known (outside a replica, or a Serve version without these internals)."""
    try:
        from ray.serve import context

        callback = context._get_internal_replica_context()._handle_registration_callback
        for cell in callback.__closure__ or ():
            replica = cell.cell_contents
            if isinstance(getattr(replica, "_shutting_down", None), bool):
                return lambda: bool(replica._shutting_down)
    except (ImportError, AttributeError, TypeError, ValueError):
        pass
    return None
