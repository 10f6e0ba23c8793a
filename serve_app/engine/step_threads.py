"""How many intra-op threads each CPU step runs on.

A CPU replica that shares its cores with another replica (two replicas x every core, with sleeping
OpenMP threads: configs/local.yaml) pays for each parallel region of a step: its sleeping threads
must be woken (about 0.1 ms each on a small VM) and the region waits for the slowest, which may have
lost its core to the other replica. A prompt's matmuls are long enough to pay for that many times
over; a decode step's, over a few dozen rows, are not: two replicas each decoding on one thread carry
more than both sharing both cores, while a lone prompt still prefills on every core.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from serve_app.engine.outputs import SchedulerOutput


class StepThreads:
    """`decode` torch threads for a step that reads no prompt token (decodes and verification rows
    only), the caller's own count for any other; `decode` 0, or not below the caller's count, changes
    nothing. Use from the thread that steps: with OpenMP the count is that thread's setting."""

    def __init__(self, decode: int) -> None:
        self.decode = decode

    @contextlib.contextmanager
    def step(self, scheduler_output: SchedulerOutput) -> Iterator[None]:
        full = torch.get_num_threads()
        if not 0 < self.decode < full or any(s.reads_prompt for s in scheduler_output.scheduled):
            yield
            return
        torch.set_num_threads(self.decode)
        try:
            yield
        finally:  # the caller's count is back after the step
            torch.set_num_threads(full)
