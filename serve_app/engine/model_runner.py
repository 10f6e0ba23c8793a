"""Model runner: turns a `SchedulerOutput` into one forward pass and a sampled token per finished chunk.

It owns the weights, the KV cache tensors and the execution paths (projections and attention, chosen
and self-checked when it starts); it never decides who runs. A step (`execute_model`):
1. orders the requests for the attention kernels (`attention_metadata.kernel_rank`: decode rows first,
   then prompt chunks) and builds the flattened batch: token ids, positions, slot mapping and block
   tables (`input_batch.InputBatch`);
2. describes the step's attention for the runner's paths: `attention_metadata.paged_metadata` (the CPU
   kernels, the reference path), a whole-step implementation (Triton, FlashInfer), or a decode CUDA
   graph's replay;
3. runs the model, computes logits only for the rows that sample (`step_sampler.sampled_rows`), masks
   constrained requests' rows with their grammar bitmasks (`logits_masks`), and hands the rest to
   `step_sampler.sample_step` (batched sampling with a per-request fallback, verification of proposed
   tokens, logprobs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from serve_app.engine import cpu_kernels
from serve_app.engine.attention import WholeStepAttentionMetadata
from serve_app.engine.attention_backends import make_varlen_attention, resolve_backend
from serve_app.engine.attention_metadata import AttentionKernels, paged_metadata
from serve_app.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from serve_app.engine.execution_paths import ExecutionPaths, limit_onednn_isa, resolve_linear
from serve_app.engine.host_memory import zeroed_cpu_tensors
from serve_app.engine.input_batch import InputBatch
from serve_app.engine.logits_masks import MaskFiller
from serve_app.engine.memory_profile import kv_cache_budget_bytes
from serve_app.engine.models.llama import LlamaArgs
from serve_app.engine.models.loader import load_model
from serve_app.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from serve_app.engine.self_check import check_prompt_len, run_check, verdict
from serve_app.engine.step_sampler import SamplingContext, drop_requests, sample_step, sampled_rows, take_rows
from serve_app.engine.step_threads import StepThreads
from serve_app.faults import FaultHook

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_cache_bytes_per_block(args: LlamaArgs, block_size: int, dtype: torch.dtype) -> int:
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, hf_config: dict[str, Any],
                 scheduler_config: SchedulerConfig | None = None) -> None:
        scheduler_config = scheduler_config or SchedulerConfig()
        self.device = torch.device(model_config.device)
        self.dtype = DTYPES[model_config.dtype]
        self.block_size = cache_config.block_size
        t0 = time.monotonic()
        self.hf_config = hf_config
        self.model_path = model_config.model
        self.model = load_model(model_config.model, hf_config, self.dtype, model_config.device)
        self.args = self.model.args
        self.backend = resolve_backend(model_config.attention_backend, self.device, self.dtype)
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        # the lm_head sees the sampled rows only: every sequence's last token and its proposed tokens
        self.max_logit_rows = scheduler_config.max_num_seqs * 4
        per_block = kv_cache_bytes_per_block(self.args, self.block_size, self.dtype)
        if cache_config.gpu_memory_utilization:
            if self.device.type != "cuda":
                raise ValueError("gpu_memory_utilization: only for CUDA devices (use kv_cache_memory_gib)")
            budget = kv_cache_budget_bytes(self.model, cache_config.gpu_memory_utilization, scheduler_config.max_num_batched_tokens,
                                           scheduler_config.max_num_seqs, self.block_size, self.device)
        else:
            budget = cache_config.kv_cache_gib * 2**30
        self.num_blocks = cache_config.num_blocks or int(budget // per_block)
        if self.num_blocks < 1:
            raise ValueError("kv_cache_memory_gib: too small for a single KV block")
        shape = (self.num_blocks, self.block_size, self.args.num_kv_heads, self.args.head_dim)
        if self.device.type == "cpu":  # on huge pages where Linux offers them (host_memory)
            flat = zeroed_cpu_tensors(shape, self.dtype, 2 * self.args.num_layers)
            self.kv_caches = list(zip(flat[0::2], flat[1::2], strict=True))
        else:
            self.kv_caches = [
                (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
                for _ in range(self.args.num_layers)
            ]
        self.kv_cache_bytes = per_block * self.num_blocks
        self.generator = torch.Generator(device=self.device).manual_seed(model_config.seed)
        self.threads = StepThreads(model_config.decode_threads)
        self.input_batch = InputBatch(self.block_size, self.device)
        self.masks = MaskFiller(self.args.vocab_size, self.device)  # structured outputs' grammar masks
        self.varlen = None
        self.decode_graphs = None
        self.decode_kernel = self.prefill_kernel = self.argmax = None
        self.batch_invariant = False
        a = self.args
        kernels = cpu_kernels.linear_kernels(
            [(a.num_heads + 2 * a.num_kv_heads) * a.head_dim, a.hidden_size, 2 * a.intermediate_size, a.vocab_size],
            [a.hidden_size, a.num_heads * a.head_dim, a.intermediate_size]) if self.device.type == "cpu" and self.dtype == torch.bfloat16 else None
        amx = limit_onednn_isa(model_config.amx) if self.device.type == "cpu" else False
        linear = resolve_linear(model_config.linear_backend, self.device, self.dtype, kernels is not None, amx)
        invariant = model_config.batch_invariant and self.device.type == "cpu" and self.dtype == torch.bfloat16
        self.paths = self._select_paths(linear, self.backend, kernels, amx, invariant)
        if self.backend in ("triton", "flashinfer"):
            self.varlen = make_varlen_attention(self.backend, self.args, self.block_size, self.dtype, self.device)
        if self.device.type == "cuda" and self.backend != "torch" and not model_config.enforce_eager:
            from serve_app.engine.cuda_graphs import DecodeGraphs

            max_len = min(self.args.max_position_embeddings, self.num_blocks * self.block_size)
            self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, min(model_config.cuda_graph_max_batch_size,
                                              scheduler_config.max_num_seqs), -(-max_len // self.block_size), self.device)
            self.decode_graphs.capture()
        logger.info("model loaded in %.1fs: %d layers, KV cache %d blocks x %d tokens (%.0f MiB)%s; %s",
                    time.monotonic() - t0, self.args.num_layers, self.num_blocks, self.block_size, self.kv_cache_bytes / 2**20,
                    " + decode CUDA graphs" if self.decode_graphs else "", self.paths.describe())

    @property
    def linear_impl(self) -> str:
        return self.paths.linear

    @property
    def shares_output_blocks(self) -> bool:
        """Whether blocks holding generated tokens may serve other requests' prompts from the prefix
        cache. Not when the engine is batch invariant with a prompt-chunk kernel: a prompt position's
        K/V then always comes from that kernel, an output position's from the decode kernel (the two
        sum in other orders), and a cache hit must give what a fresh prefill would."""
        return not (self.batch_invariant and self.prefill_kernel is not None)

    def _use_paths(self, linear: str, attention: str, kernels, invariant: bool) -> dict:
        """Configure the loaded model and this runner for these paths; returns each projection's row tiling."""
        tiles = self.model.configure_projections(linear, kernels, invariant, self.max_num_batched_tokens, self.max_logit_rows)
        cpu_ops = attention in ("cpu_kernel", "cpu_decode")
        if cpu_ops and self.dtype == torch.bfloat16:
            self.model.use_rms_norm_op(cpu_kernels.op("rms_norm_bf16"))
            self.model.use_add_rms_norm_op(cpu_kernels.op("add_rms_norm_bf16"))
            self.model.use_rope_write_kv_op(cpu_kernels.op("rope_write_kv_bf16"))
        self.decode_kernel = cpu_kernels.op("paged_decode") if cpu_ops else None
        # prompt chunks get their own kernel where it runs: bf16, AVX512-BF16, head_dim 64 or 128
        supported = cpu_kernels.op("paged_prefill_supported") if self.decode_kernel is not None and attention == "cpu_kernel" else None
        self.prefill_kernel = (cpu_kernels.op("paged_prefill") if supported is not None and self.dtype == torch.bfloat16
                               and supported(self.args.head_dim) else None)
        self.argmax = cpu_kernels.op("argmax_rows") if cpu_ops else None
        # invariance needs the decode kernel: the reference path's SDPA depends on the batch's shapes
        self.batch_invariant = invariant and self.decode_kernel is not None
        return tiles

    def _select_paths(self, linear: str, attention: str, kernels, amx: bool, invariant: bool) -> ExecutionPaths:
        """Configure `linear` / `attention` and run the self-check (CPU only); on a failure, log why and
        fall back to torch's projections with the decode kernel, then to the reference path."""
        length = check_prompt_len(self.num_blocks, self.block_size)
        if self.device.type != "cpu" or not length:
            tiles = self._use_paths(linear, attention, kernels, invariant)
            return ExecutionPaths(linear, attention, amx and linear == "onednn", self.batch_invariant, tuple(tiles.items()),
                                  "not run: " + ("not on CPU" if self.device.type != "cpu" else "KV cache too small"))
        reference = run_check(self, length)  # the reference path: dense weights, torch attention (nothing configured yet)
        candidates = [(linear, attention, invariant), ("dense", "cpu_decode", invariant), ("dense", "torch", False)]
        failures = []
        for i, (lin, att, inv) in enumerate(candidates):
            if i:
                self.model = load_model(self.model_path, self.hf_config, self.dtype, str(self.device))
            tiles = self._use_paths(lin, att, kernels, inv)
            problem = verdict(run_check(self, length), reference, self.batch_invariant)
            if problem is None:
                check = "passed" if not failures else f"fell back: {'; '.join(failures)}"
                return ExecutionPaths(lin, att, amx and lin == "onednn", self.batch_invariant, tuple(tiles.items()), check)
            failures.append(f"{lin}/{att}: {problem}")
            logger.warning("self-check: projections %s with attention %s failed (%s); trying the next paths", lin, att, problem)
        raise RuntimeError(f"self-check: even the reference path failed: {'; '.join(failures)}")

    def _kernels(self) -> AttentionKernels:
        """The CPU attention kernels of this runner's paths now (`_use_paths` sets them)."""
        return AttentionKernels(self.decode_kernel, self.prefill_kernel, self.batch_invariant)

    def _order(self, scheduled: Sequence[ScheduledRequest]) -> list[ScheduledRequest]:
        """A step's requests in row order (`attention_metadata.kernel_rank`; stable)."""
        return self._kernels().order(scheduled)

    def _forward(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(hidden [T, hidden], None) or, for a step that replayed a decode CUDA graph, (None, logits [T, vocab]).
        `scheduled` must be in `_order`."""
        step = self.input_batch.build(scheduled)
        if self.varlen is None:  # (decode graphs come only with a varlen backend)
            meta = paged_metadata(step, scheduled, self._kernels(), self.block_size)
        elif self.decode_graphs is not None and self.decode_graphs.can_run(step):
            return None, self.decode_graphs.run(step)
        else:
            self.varlen.plan(step)
            meta = WholeStepAttentionMetadata(self.varlen, step)
        return self.model(step.input_ids, step.positions, self.kv_caches, meta), None

    @torch.inference_mode()
    def sampling_logits(self, scheduled: Sequence[ScheduledRequest]) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """Run one forward pass; return the requests that sample (decodes first) and the logits of
        their sampled positions ([rows, V]: 1 + len(spec_token_ids) consecutive rows per request)."""
        scheduled = self._order(scheduled)
        hidden, graph_logits = self._forward(scheduled)
        samplers, rows = sampled_rows(scheduled)
        if not samplers:
            return [], torch.empty(0)
        if hidden is None:
            return samplers, take_rows(graph_logits, rows)
        return samplers, self.model.compute_logits(take_rows(hidden, rows))

    def _sampling(self) -> SamplingContext:
        """Built per step: the argmax follows the paths (a self-check fallback, a profiler's wrapper)."""
        return SamplingContext(self.generator, self.argmax, self.fault_hook)

    fault_hook: FaultHook | None = None  # tests only (serve_app/faults.py), installed by LLMEngine

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        with self.threads.step(scheduler_output):
            return self._execute(scheduler_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # constrained requests' masks: filled ahead (during the forward where a core is free) or checked after it
        masks = self.masks.start([s for s in self._order(scheduler_output.scheduled) if s.sample])
        samplers, logits = self.sampling_logits(scheduler_output.scheduled)
        if not samplers:
            return ModelRunnerOutput((), ())
        failed: dict[str, str] = {}
        if masks is not None:
            # logprobs are of the masked distribution (as vLLM's): the grammar's forbidden tokens at -inf
            failed = masks.apply(logits, self.argmax)
            if failed:
                samplers, logits = drop_requests(samplers, logits, failed)
        out = sample_step(samplers, logits, self._sampling()) if samplers else ModelRunnerOutput((), ())
        if masks is not None:
            out = replace(out, mask_s=masks.seconds, failed=out.failed + tuple(failed.items()))
        return out
