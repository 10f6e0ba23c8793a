"""CUDA graphs for decode steps: one captured forward pass (+ logits) per bucketed batch size.

A decode step of b sequences (b <= the largest bucket) copies its inputs into persistent device
buffers sized for the bucket B >= b, pads rows b..B-1 (slot -1: no KV write; no queries, length 0:
no attention), and replays the graph captured at B: 30 layers' kernels launch as one, with no
Python in between. The attention inside is the Triton kernel (`attention_triton`), whose grid
depends only on B, and every shape and address in the graph is fixed at capture.
Only decodes (one token per sequence) are captured; prompt chunks run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from serve_app.engine.attention import WholeStepAttentionMetadata
from serve_app.engine.attention_triton import TritonAttention
from serve_app.engine.input_batch import StepInputs

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 (16 from 128 on, as vLLM does) up to `max_batch` (always included)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, 128, 8)) + list(range(128, max_batch + 1, 16))
    return sorted({b for b in sizes if b < max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_batch: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = batch_buckets(max_batch)
        self.attention = TritonAttention()
        big = self.buckets[-1]
        self.input_ids = torch.zeros(big, dtype=torch.long, device=device)
        self.positions = torch.zeros(big, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((big,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(big, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(big + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(big, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.num_replays = 0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _forward(self, b: int) -> torch.Tensor:
        step = StepInputs(
            input_ids=self.input_ids[:b], positions=self.positions[:b], slot_mapping=self.slot_mapping[:b],
            seq_lens=self.seq_lens[:b], query_start_loc=self.query_start_loc[: b + 1], block_tables=self.block_tables[:b],
            num_seqs=b, num_tokens=b, max_query_len=1, max_seq_len=0,
            host_seq_lens=None, host_query_start_loc=None, host_block_tables=None,
        )
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, WholeStepAttentionMetadata(self.attention, step))
        return self.model.compute_logits(hidden)  # [b, vocab] fp32

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, all in one memory pool (smaller graphs reuse the largest one's memory)."""
        t0 = time.monotonic()
        pool = None
        for b in reversed(self.buckets):
            self._forward(b)  # warm-up: compiles the Triton kernels, settles the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1fs", len(self.buckets), self.buckets[0],
                    self.buckets[-1], time.monotonic() - t0)

    def can_run(self, step: StepInputs) -> bool:
        return step.max_query_len == 1 and step.num_seqs <= self.max_batch and step.block_tables.shape[1] <= self.block_tables.shape[1]

    def run(self, step: StepInputs) -> torch.Tensor:
        """Logits [b, vocab] of a decode step (a view into the graph's output: use before the next run)."""
        b = step.num_seqs
        big = self.buckets[bisect.bisect_left(self.buckets, b)]
        nb = step.block_tables.shape[1]
        self.input_ids[:b].copy_(step.input_ids)
        self.positions[:b].copy_(step.positions)
        self.slot_mapping[:b].copy_(step.slot_mapping)
        self.slot_mapping[b:big].fill_(-1)
        self.seq_lens[:b].copy_(step.seq_lens)
        self.seq_lens[b:big].fill_(0)
        self.query_start_loc[: b + 1].copy_(step.query_start_loc)
        self.query_start_loc[b + 1 : big + 1].fill_(b)
        self.block_tables[:b, :nb].copy_(step.block_tables)
        self.graphs[big].replay()
        self.num_replays += 1
        return self.logits[big][:b]
