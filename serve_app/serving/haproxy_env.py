"""The environment that puts Ray Serve's HTTP front on HAProxy (Ray 2.60's `RAY_SERVE_ENABLE_HA_PROXY`)
for one Ray instance, isolated from any other instance on the same machine.

Ray reads these variables when its modules are imported and when its processes start: apply them to
`os.environ` before `import ray.serve` in the driver and before `ray.init` (the raylet, the controller,
the HAProxy manager and every replica inherit them). HAProxy's files default to one fixed directory
(/tmp/haproxy-serve: config, admin socket, server state) and its stats and metrics to fixed ports
(8404, 9101): two instances on one machine would overwrite each other's config, so each gets its own
directory and free ports here.

What HAProxy mode itself implies (Ray's choice, not ours): direct ingress is forced on, so every
ingress replica runs an HTTP server on a port from `RAY_SERVE_DIRECT_INGRESS_MIN/MAX_HTTP_PORT`
bound to all interfaces (HAProxy on other nodes must reach it), whatever Serve's HTTP host is;
HAProxy itself binds Serve's HTTP host and port.
"""

from __future__ import annotations

from pathlib import Path

from serve_app.metrics.local_stack import free_port

HAPROXY = "RAY_SERVE_ENABLE_HA_PROXY"
LLM_DIRECT_STREAMING = "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING"


def haproxy_env(workdir: Path) -> dict[str, str]:
    """HAProxy on, with its files under `workdir` (created) and its stats and metrics on free ports."""
    workdir.mkdir(parents=True, exist_ok=True)
    return {
        HAPROXY: "1",
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(workdir / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(workdir / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(workdir),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(workdir / "server-state"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
    }
