"""A step's model inputs, built in persistent host buffers with array operations.

The flattened batch is what every attention backend reads: the sequences in scheduling order,
sequence s owning tokens `query_start_loc[s] : query_start_loc[s + 1]` at the last positions of its
`seq_lens[s]` tokens. Per step the only Python-level loop is over the scheduled sequences (to copy
their token ids and block tables into the buffers); positions and slots are computed for all tokens
at once. On CUDA the host buffers are pinned and go to the device in one non-blocking copy each;
`build` does not write them again before those copies have run (an event marks them), since a step
that samples nothing ends without a host sync. Buffers grow (doubling) when a step needs more rows
than they have, and are reused otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from serve_app.engine.outputs import ScheduledRequest


@dataclass(frozen=True)
class StepInputs:
    """Device tensors of one step (views of persistent buffers: valid until the next `build`)."""

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long
    seq_lens: torch.Tensor  # [S] int32: context length after this step
    query_start_loc: torch.Tensor  # [S + 1] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32 (rows padded with 0)
    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    # host copies (numpy views of the same buffers) for planners that work on the CPU (FlashInfer)
    host_seq_lens: np.ndarray
    host_query_start_loc: np.ndarray
    host_block_tables: np.ndarray


class InputBatch:
    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self._pin = device.type == "cuda"
        # recorded after each step's copies out of the pinned buffers (CUDA only)
        self._copied = torch.cuda.Event() if self._pin else None
        self._tokens = self._seqs = self._blocks = 0
        self._grow(256, 64, 16)

    def _grow(self, tokens: int, seqs: int, blocks: int) -> None:
        self._tokens, self._seqs, self._blocks = max(tokens, self._tokens), max(seqs, self._seqs), max(blocks, self._blocks)

        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=self._pin)

        # token-indexed: input_ids, positions, slot_mapping; sequence-indexed: seq_lens, query_start_loc
        self._h_tok = host(3, self._tokens, dtype=torch.long)
        self._h_seq = host(2, self._seqs + 1, dtype=torch.int32)
        self._h_bt = host(self._seqs, self._blocks, dtype=torch.int32)
        on_host = self.device.type == "cpu"  # the host buffers are the inputs
        self._d_tok = self._h_tok if on_host else torch.empty_like(self._h_tok, device=self.device)
        self._d_seq = self._h_seq if on_host else torch.empty_like(self._h_seq, device=self.device)
        self._d_bt = self._h_bt if on_host else torch.empty_like(self._h_bt, device=self.device)

    def build(self, scheduled: Sequence[ScheduledRequest]) -> StepInputs:
        # The previous step's copies read the pinned buffers when the stream reaches them: a step that
        # sampled something synced the host on its sampled ids (they are done), but one of prompt
        # chunks only did not, and its copies may still wait behind an earlier forward pass. (query
        # first: no host sync when they are done, as after every sampling step.)
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()
        num_seqs = len(scheduled)
        query_lens = np.fromiter((s.num_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        start_pos = np.fromiter((s.start_pos for s in scheduled), dtype=np.int64, count=num_seqs)
        table_lens = np.fromiter((len(s.block_table) for s in scheduled), dtype=np.int64, count=num_seqs)
        num_tokens = int(query_lens.sum())
        max_blocks = int(table_lens.max())
        if num_tokens > self._tokens or num_seqs > self._seqs or max_blocks > self._blocks:
            self._grow(2 * num_tokens, 2 * num_seqs, 2 * max_blocks)
        tok = self._h_tok.numpy()
        seq = self._h_seq.numpy()
        bt = self._h_bt.numpy()
        ids, positions, slots = tok[0, :num_tokens], tok[1, :num_tokens], tok[2, :num_tokens]
        ids[:] = np.fromiter((t for s in scheduled for t in s.token_ids), dtype=np.int64, count=num_tokens)
        bt[:num_seqs, :max_blocks] = 0
        for i, s in enumerate(scheduled):
            bt[i, : len(s.block_table)] = s.block_table
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        qsl = seq[1, : num_seqs + 1]
        qsl[0] = 0
        np.cumsum(query_lens, out=qsl[1:])
        positions[:] = start_pos[seq_of_token] + np.arange(num_tokens) - qsl[:-1][seq_of_token]
        slots[:] = bt[seq_of_token, positions // self.block_size].astype(np.int64) * self.block_size + positions % self.block_size
        seq_lens = seq[0, :num_seqs]
        seq_lens[:] = start_pos + query_lens
        d_tok, d_seq, d_bt = self._d_tok, self._d_seq, self._d_bt
        if d_tok is not self._h_tok:
            d_tok[:, :num_tokens].copy_(self._h_tok[:, :num_tokens], non_blocking=True)
            d_seq[:, : num_seqs + 1].copy_(self._h_seq[:, : num_seqs + 1], non_blocking=True)
            d_bt[:num_seqs].copy_(self._h_bt[:num_seqs], non_blocking=True)
            self._copied.record(torch.cuda.current_stream(self.device))  # the stream the copies went to
        return StepInputs(
            input_ids=d_tok[0, :num_tokens],
            positions=d_tok[1, :num_tokens],
            slot_mapping=d_tok[2, :num_tokens],
            seq_lens=d_seq[0, :num_seqs],
            query_start_loc=d_seq[1, : num_seqs + 1],
            block_tables=d_bt[:num_seqs, :max_blocks],
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            host_seq_lens=seq_lens,
            host_query_start_loc=qsl,
            host_block_tables=bt[:num_seqs, :max_blocks],
        )
