"""An engine in a process of its own (its peak RSS its own, its imports out of the benchmark's process, a crash a
result): `Worker("loadtest.engines:build", opts)` spawns a process that builds `build(opts)` and answers calls,
`worker.call("run", prompts, 128)` → its `run(prompts, 128)`. A failure there raises `WorkerError` here; the
worker goes on serving after a failed call, not after a failed build or its death.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import threading
import time
import traceback
from typing import Any

from loadtest import machine


class WorkerError(RuntimeError):
    pass


def _call(conn, fn, *args: Any) -> bool:
    """Send fn(*args), or the traceback of its failure; whether it succeeded."""
    try:
        conn.send(("result", fn(*args)))
        return True
    except Exception:  # noqa: BLE001 - the parent reports it
        conn.send(("error", traceback.format_exc()))
        return False


def _serve(target: str, opts: dict[str, Any], conn) -> None:
    module, _, name = target.partition(":")
    built: list[Any] = []
    if _call(conn, lambda: built.append(getattr(importlib.import_module(module), name)(opts))):
        while (msg := conn.recv())[0] != "stop":
            _call(conn, getattr(built[0], msg[0]), *msg[1])
    conn.close()


class Worker:
    """The process, its process tree's peak RSS sampled every 0.1 s (psutil; 0 without it); `with Worker(...) as w:`
    stops it at the end of the block."""

    def __init__(self, target: str, opts: dict[str, Any], timeout_s: float = 3600.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(target, opts, child), name=target.rpartition(":")[2])  # not a daemon: vLLM starts processes
        self.proc.start()
        child.close()
        self.timeout_s, self.peak_rss, self._halt, started = timeout_s, 0, threading.Event(), time.perf_counter()
        threading.Thread(target=self._sample_rss, daemon=True).start()
        try:
            self._answer()
        except WorkerError:
            self.stop()
            raise
        self.load_s = time.perf_counter() - started

    def _sample_rss(self) -> None:
        while not self._halt.wait(0.1):
            self.peak_rss = max(self.peak_rss, machine.rss_bytes(machine.tree(self.proc.pid)))

    def _answer(self) -> Any:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.conn.poll(1.0):
                try:
                    kind, value = self.conn.recv()
                except EOFError:
                    break
                if kind == "error":
                    raise WorkerError(value.strip().splitlines()[-1] + "\n" + value)
                return value
            if not self.proc.is_alive() and not self.conn.poll(0):
                break
        raise WorkerError(f"{self.proc.name}: " + ("timed out" if self.proc.is_alive() else f"died (exit code {self.proc.exitcode})"))

    def call(self, method: str, *args: Any) -> Any:
        try:
            self.conn.send((method, args))
        except OSError as exc:  # (a broken pipe)
            raise WorkerError(f"{self.proc.name}: gone ({exc!r})") from exc
        return self._answer()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._halt.set()
        with contextlib.suppress(OSError):
            self.conn.send(("stop", ()))
        self.proc.join(30)
        if self.proc.is_alive():
            for p in machine.tree(self.proc.pid)[1:]:  # e.g. vLLM's engine-core process
                p.kill()
            self.proc.kill()
            self.proc.join()
