"""Model runner: turns a `SchedulerOutput` into one forward pass and a sampled token per finished chunk.

It owns the weights and the KV cache tensors; it never decides who runs. Per step it builds the
flattened batch (decode tokens first, then prompt chunks), the slot mapping and block tables, runs
the model, computes logits only for the rows that sample, and samples. A request verified with
proposed tokens (speculative decoding) samples each of its last `1 + k` rows, and keeps the samples
up to the first one that differs from its proposal (`spec_decode.acceptance.accept`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from serve_app.config import CacheConfig, ModelConfig
from serve_app.engine import cpu_kernels
from serve_app.engine.attention import AttentionMetadata, PrefillChunk
from serve_app.engine.models.llama import LlamaArgs
from serve_app.engine.models.loader import load_model
from serve_app.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from serve_app.engine.sampler import sample
from serve_app.engine.spec_decode.acceptance import accept

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_cache_bytes_per_block(args: LlamaArgs, block_size: int, dtype: torch.dtype) -> int:
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()


def is_decode(s: ScheduledRequest) -> bool:
    """A request reading one new token, or verifying proposed tokens after it (one decode row each)."""
    return s.num_tokens == 1 or bool(s.spec_token_ids)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, hf_config: dict[str, Any]) -> None:
        self.device = torch.device(model_config.device)
        self.dtype = DTYPES[model_config.dtype]
        self.block_size = cache_config.block_size
        t0 = time.monotonic()
        self.model = load_model(model_config.model, hf_config, self.dtype, model_config.device)
        self.args = self.model.args
        self.packed_weights = self.model.pack_linear_weights()
        use_cpu_ops = self.device.type == "cpu" and model_config.attention_backend == "auto"
        if use_cpu_ops and self.dtype == torch.bfloat16:
            self.model.use_rms_norm_op(cpu_kernels.rms_norm_bf16_op())
        per_block = kv_cache_bytes_per_block(self.args, self.block_size, self.dtype)
        self.num_blocks = cache_config.num_blocks or int(cache_config.kv_cache_memory_gib * 2**30 // per_block)
        if self.num_blocks < 1:
            raise ValueError("kv_cache_memory_gib: too small for a single KV block")
        shape = (self.num_blocks, self.block_size, self.args.num_kv_heads, self.args.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.args.num_layers)
        ]
        self.kv_cache_bytes = per_block * self.num_blocks
        self.decode_kernel = cpu_kernels.paged_decode_kernel() if use_cpu_ops else None
        self.generator = torch.Generator(device=self.device).manual_seed(model_config.seed)
        logger.info(
            "model loaded in %.1fs: %d layers, KV cache %d blocks x %d tokens (%.0f MiB), decode kernel: %s, weights: %s",
            time.monotonic() - t0, self.args.num_layers, self.num_blocks, self.block_size,
            self.kv_cache_bytes / 2**20, "C++" if self.decode_kernel else "torch",
            "oneDNN packed" if self.packed_weights else "dense",
        )

    def _tensor(self, data: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _slots(self, sched: ScheduledRequest) -> list[int]:
        bs, table = self.block_size, sched.block_table
        return [table[p // bs] * bs + p % bs for p in range(sched.start_pos, sched.context_len)]

    def prepare(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """`scheduled` must list decodes first (`is_decode`). A verification (a decode with proposed
        tokens) runs as one decode row per token, each over the context up to its own position:
        its K/V are all written before attention, so that is exactly causal attention."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decodes = [s for s in scheduled if is_decode(s)]
        for s in scheduled:
            input_ids.extend(s.token_ids)
            positions.extend(range(s.start_pos, s.context_len))
            slots.extend(self._slots(s))
        block_tables = context_lens = mask = None
        num_decode_rows = sum(s.num_tokens for s in decodes)
        if decodes:
            max_blocks = max(len(s.block_table) for s in decodes)
            block_tables = self._tensor([list(s.block_table) + [0] * (max_blocks - len(s.block_table))
                                         for s in decodes for _ in range(s.num_tokens)])
            context_lens = self._tensor([p + 1 for s in decodes for p in range(s.start_pos, s.context_len)], torch.int32)
            if self.decode_kernel is None:
                keys = torch.arange(max_blocks * self.block_size, device=self.device)
                mask = (keys.unsqueeze(0) < context_lens.unsqueeze(1)).view(num_decode_rows, 1, 1, -1)
        prefills = []
        offset = num_decode_rows
        for s in scheduled[len(decodes) :]:
            table = chunk_mask = None
            if s.start_pos > 0:
                table = self._tensor(list(s.block_table))
                q_pos = torch.arange(s.start_pos, s.context_len, device=self.device)
                chunk_mask = torch.arange(s.context_len, device=self.device).unsqueeze(0) <= q_pos.unsqueeze(1)
            prefills.append(PrefillChunk(offset, s.num_tokens, s.start_pos, table, chunk_mask))
            offset += s.num_tokens
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decodes=num_decode_rows,
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            decode_mask=mask,
            prefills=tuple(prefills),
            decode_kernel=self.decode_kernel,
        )
        return self._tensor(input_ids), self._tensor(positions), meta

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        scheduled = sorted(scheduler_output.scheduled, key=lambda s: not is_decode(s))  # stable: decodes first
        input_ids, positions, meta = self.prepare(scheduled)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        rows, samplers, params, keys = [], [], [], []
        end = 0
        for s in scheduled:
            end += s.num_tokens
            if s.sample:
                num_rows = 1 + len(s.spec_token_ids)  # the last token and each proposed one predict a token
                rows.extend(range(end - num_rows, end))
                samplers.append(s)
                params.extend([s.sampling_params] * num_rows)
                keys.extend((s.generator_key, *s.spec_generator_keys))
        if not samplers:
            return ModelRunnerOutput((), ())
        logits = self.model.compute_logits(hidden[self._tensor(rows)])
        token_ids = sample(logits, params, keys, self.generator)
        if len(token_ids) == len(samplers):
            return ModelRunnerOutput(tuple(s.request_id for s in samplers), tuple(token_ids))
        accepted, at = [], 0
        for s in samplers:
            num_rows = 1 + len(s.spec_token_ids)
            accepted.append(accept(token_ids[at : at + num_rows], s.spec_token_ids))
            at += num_rows
        return ModelRunnerOutput(tuple(s.request_id for s in samplers), tuple(a[0] for a in accepted), tuple(a[1:] for a in accepted))
