"""The environment that puts Ray Serve's HTTP front on HAProxy (Ray 2.60's `RAY_SERVE_ENABLE_HA_PROXY`)
for one Ray instance, isolated from any other instance on the same machine.

Ray reads these variables when its modules are imported and when its processes start: apply them to
`os.environ` before `import ray.serve` in the driver and before `ray.init` (the raylet, the controller,
the HAProxy manager and every replica inherit them). HAProxy's files default to one fixed directory
(/tmp/haproxy-serve: config, admin socket, server state) and its stats and metrics to fixed ports
(8404, 9101): two instances on one machine would overwrite each other's config, so each gets its own
directory and free ports here. HAProxy puts its admin socket in a per-node subdirectory (the 56-hex
node id) and refuses a socket path over 97 characters: the directory must be short, /tmp/hap-XXXX.

What HAProxy mode itself implies (Ray's choice, not ours): direct ingress is forced on, so every
ingress replica runs an HTTP server on a port from `RAY_SERVE_DIRECT_INGRESS_MIN/MAX_HTTP_PORT`
bound to all interfaces (HAProxy on other nodes must reach it), whatever Serve's HTTP host is;
HAProxy itself binds Serve's HTTP host and port.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from serve_app.metrics.local_stack import free_port

HAPROXY = "RAY_SERVE_ENABLE_HA_PROXY"
LLM_DIRECT_STREAMING = "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING"
STATE_DIR = "RAY_SERVE_HAPROXY_SERVER_STATE_BASE"  # the directory `haproxy_env` made (the caller removes it)
MAX_DIR_CHARS = 97 - len("/") - 56 - len("/metrics.sock")  # HAProxy's socket-path limit, less node id and name


def haproxy_env() -> dict[str, str]:
    """HAProxy on, with its files in a new directory of its own (`STATE_DIR`) and its stats and
    metrics on free ports."""
    workdir = Path(tempfile.mkdtemp(prefix="hap-", dir="/tmp"))
    if len(str(workdir)) > MAX_DIR_CHARS:  # pragma: no cover - /tmp is short
        raise ValueError(f"{workdir}: too long for HAProxy's socket paths (at most {MAX_DIR_CHARS} characters)")
    return {
        HAPROXY: "1",
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(workdir / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(workdir / "admin.sock"),
        STATE_DIR: str(workdir),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(workdir / "metrics.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(workdir / "server-state"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
    }


def wait_for_haproxy(state_dir: Path, timeout_s: float = 60.0) -> None:
    """Until HAProxy's config (in its node's directory under `state_dir`) lists an ingress replica, and a
    moment for its reload: before that it sends requests to Serve's proxy, its backup server."""
    deadline = time.monotonic() + timeout_s
    while not any("server SERVE_REPLICA_" in cfg.read_text() for cfg in state_dir.glob("*/haproxy.cfg")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"HAProxy's config lists no ingress replica after {timeout_s:g} s")
        time.sleep(0.2)
    time.sleep(1.0)
