"""Per-row logits edits for structured outputs and `logit_bias`, applied before sampling.

Only rows that need them are touched: a step without a constrained row allocates nothing and starts
no work, and an unconstrained row's logits are never written (batch invariance: a neighbour's
constraint changes nothing of a row's own). A constrained row's mask depends on its own matcher only.

The bitmask of a step's constrained rows is filled by one worker thread while the forward pass runs
(`MaskFiller.start` before it, `StepMasks.apply` after it) when that thread has a core of its own:
xgrammar's mask fill is C++ that releases the GIL, so the two overlap on a GPU or when the CPU
forward leaves a core free. When the forward's threads use every core, the fill has no core to
overlap on (a third busy thread can only take one from the forward's parallel regions), so there it
runs in the engine thread before the forward. Measured on 2 quiet cores with 2 torch threads, both
placements gave the same step time (docs/structured-outputs.md).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from serve_app.engine.outputs import ScheduledRequest
from serve_app.types import SamplingParams

logger = logging.getLogger(__name__)


class StepMasks:
    """One step's grammar bitmask, being filled."""

    def __init__(self, future: Future, rows: list[int], bitmask: torch.Tensor) -> None:
        self.future = future
        self.rows = rows  # the logits rows to mask (constrained requests' sampled positions)
        self.bitmask = bitmask  # [R, ceil(V / 32)] int32 over all sampled rows (unconstrained rows: all allowed)
        self.seconds = 0.0  # fill + apply time, set by `apply`

    def apply(self, logits: torch.Tensor) -> dict[str, str]:
        """Wait for the fill, mask `logits` ([R, V] fp32) in place at the constrained rows; returns the
        requests whose fill raised (request id → what went wrong): they must not be sampled."""
        failed, fill_s = self.future.result()
        start = time.perf_counter()
        rows = self.rows
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, self.bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=logits.shape[-1], indices=rows)
        self.seconds = fill_s + time.perf_counter() - start
        return failed


class MaskFiller:
    """Starts each step's bitmask fill: in a worker thread (`overlap`), else at once in the caller's thread."""

    def __init__(self, vocab_size: int, device: torch.device, overlap: bool | None = None) -> None:
        """`overlap` None: fill during the forward on a GPU, or on a CPU with a core the forward's
        threads leave free; else in the caller's thread, before it."""
        self.words = (vocab_size + 31) // 32
        if overlap is None:
            overlap = device.type != "cpu" or (os.cpu_count() or 1) > torch.get_num_threads()
        self.overlap = overlap
        self._executor: ThreadPoolExecutor | None = None

    def start(self, samplers: Sequence[ScheduledRequest]) -> StepMasks | None:
        """`samplers`: the step's sampling requests in row order (1 + len(spec_token_ids) rows each)."""
        jobs, rows, at = [], [], 0
        for s in samplers:
            n = 1 + len(s.spec_token_ids)
            if s.grammar is not None:
                jobs.append((s, at))
                rows.extend(range(at, at + n))
            at += n
        if not jobs:
            return None
        bitmask = torch.full((at, self.words), -1, dtype=torch.int32)
        if self.overlap:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
            future = self._executor.submit(_fill, jobs, bitmask)
        else:
            future = Future()
            future.set_result(_fill(jobs, bitmask))
        return StepMasks(future, rows, bitmask)


def _fill(jobs: list[tuple[ScheduledRequest, int]], bitmask: torch.Tensor) -> tuple[dict[str, str], float]:
    start = time.perf_counter()
    failed = {}
    for s, at in jobs:
        try:
            s.grammar.fill_rows(bitmask, at, s.spec_token_ids)
        except Exception as exc:  # noqa: BLE001 - this request's own fault: it alone is aborted
            logger.exception("filling the grammar mask failed for request %s", s.request_id)
            failed[s.request_id] = f"{type(exc).__name__}: {exc}"
    return failed, time.perf_counter() - start


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`logits` ([S, V] fp32) with each row's `logit_bias` added: a new tensor when any row has one,
    else `logits` itself."""
    if not any(p.logit_bias for p in params):
        return logits
    out = logits.clone()
    for row, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=logits.device)
            out[row].index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype, device=logits.device))
    return out
