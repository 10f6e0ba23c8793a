"""Model runner: turns a `SchedulerOutput` into one forward pass and a sampled token per finished chunk.

It owns the weights and the KV cache tensors; it never decides who runs. Per step it builds the
flattened batch (decode tokens first, then prompt chunks), the slot mapping and block tables, runs
the model, computes logits only for the rows that sample, and samples. A request verified with
proposed tokens (speculative decoding) samples each of its last `1 + k` rows, and keeps the samples
up to the first one that differs from its proposal (`spec_decode.acceptance.accept`), or, for
proposals sampled from a draft model's distribution, by rejection sampling (`spec_decode.rejection`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from serve_app.engine import cpu_kernels
from serve_app.engine.attention import AttentionMetadata, KernelChunks, PrefillChunk
from serve_app.engine.attention_backends import make_varlen_attention, resolve_backend
from serve_app.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from serve_app.engine.execution_paths import ExecutionPaths, limit_onednn_isa, resolve_linear
from serve_app.engine.host_memory import zeroed_cpu_tensors
from serve_app.engine.input_batch import InputBatch
from serve_app.engine.logits_masks import MaskFiller, apply_logit_bias
from serve_app.engine.logprobs import sampled_logprobs
from serve_app.engine.memory_profile import kv_cache_budget_bytes
from serve_app.engine.models.llama import LlamaArgs
from serve_app.engine.models.loader import load_model
from serve_app.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from serve_app.engine.penalties import process_logits
from serve_app.engine.sampler import sample, sampling_probs
from serve_app.engine.self_check import check_prompt_len, run_check, verdict
from serve_app.engine.spec_decode.acceptance import accept
from serve_app.engine.spec_decode.rejection import rejection_sample
from serve_app.faults import FaultHook, Stage

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_cache_bytes_per_block(args: LlamaArgs, block_size: int, dtype: torch.dtype) -> int:
    return 2 * args.num_layers * block_size * args.num_kv_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()


# Without the prompt-chunk kernel (`cpu_kernels.paged_prefill`), a fresh prompt chunk up to this many
# tokens is attended by the CPU decode kernel, one row per token over its causal context (its K/V are
# in the cache by then), instead of torch's SDPA: measured in bf16 at SmolLM2's shapes, 16 prompts x
# 128 tokens 2.7x faster, 4 x 512 1.9x, 2 x 1,024 1.3x, one of 2,048 0.92x. A chunk that continues a
# request (start_pos > 0) always goes to a kernel: the torch path would gather its whole context and
# run a full masked attention. With the prompt-chunk kernel every prompt chunk goes to it (one of
# 2,048 fresh tokens: attention 3.9-4.7x faster than SDPA, the step 2.1x; docs/engine-kernels.md).
KERNEL_MAX_FRESH_CHUNK = 1024


def is_decode(s: ScheduledRequest) -> bool:
    """Rows at output positions: a decode, a verification with proposed tokens, a recomputed run of
    generated tokens (one decode row each). A chunk of prompt tokens is never one, even of a single
    token: each position's K/V always comes from the same kernel, whatever the chunking."""
    return not s.reads_prompt or bool(s.spec_token_ids)


def kernel_rank(s: ScheduledRequest, kernel: bool = True, chunk_kernel: bool = False, invariant: bool = False) -> int:
    """A step's requests in row order: decodes (0), then the prompt chunks a kernel attends (1, only
    with a decode `kernel`: all of them with the prompt-chunk kernel or when batch `invariant`, else
    those within KERNEL_MAX_FRESH_CHUNK or continuing a request), then those torch's SDPA does (2);
    each group a contiguous run of rows. Ranks 0 and 1 are the rows `prepare` hands to the
    block-table path."""
    if is_decode(s):
        return 0
    if not kernel:
        return 2
    return 1 if chunk_kernel or invariant or s.start_pos > 0 or s.num_tokens <= KERNEL_MAX_FRESH_CHUNK else 2


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
        self.input_batch = InputBatch(self.block_size, self.device)
        self.masks = MaskFiller(self.args.vocab_size, self.device)  # structured outputs' bitmasks, filled during the forward
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

    def _tensor(self, data: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def prepare(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Inputs for the decode-kernel / reference paths. `scheduled` must be in `_order`. A
        verification (a decode with proposed tokens), and with the kernel a prompt chunk, runs as one
        kernel row per token, each over the context up to its own position: its K/V are all written
        before attention, so that is exactly causal attention. With the prompt-chunk kernel, the
        chunks of rank 1 go to it instead (`KernelChunks`), whole."""
        step = self.input_batch.build(scheduled)
        end = next((i for i, s in enumerate(scheduled) if self._rank(s) == 2), len(scheduled))
        b = end  # requests attended as decode-kernel rows
        if self.prefill_kernel is not None:
            b = next((i for i, s in enumerate(scheduled[:end]) if self._rank(s) == 1), end)
        num_decode_rows = sum(s.num_tokens for s in scheduled[:b])
        block_tables = context_lens = mask = None
        if b:
            max_blocks = max(len(s.block_table) for s in scheduled[:b])
            if num_decode_rows == b:  # plain decodes: the persistent inputs as they are
                block_tables = step.block_tables[:b, :max_blocks].to(torch.long, memory_format=torch.contiguous_format)
                context_lens = step.seq_lens[:b]
            else:  # verifications, prompt chunks: one row per token, each with its request's table and its own context
                rows_per_seq = self._tensor([s.num_tokens for s in scheduled[:b]])
                block_tables = step.block_tables[:b, :max_blocks].to(torch.long).repeat_interleave(rows_per_seq, dim=0)
                context_lens = (step.positions[:num_decode_rows] + 1).to(step.seq_lens.dtype)
            if self.decode_kernel is None:
                keys = torch.arange(max_blocks * self.block_size, device=self.device)
                mask = (keys.unsqueeze(0) < context_lens.unsqueeze(1)).view(num_decode_rows, 1, 1, -1)
        chunks = None
        if b < end:
            qsl = step.query_start_loc[b : end + 1]
            chunks = KernelChunks(
                num_rows=sum(s.num_tokens for s in scheduled[b:end]),
                block_tables=step.block_tables[b:end, : max(len(s.block_table) for s in scheduled[b:end])].to(
                    torch.long, memory_format=torch.contiguous_format),
                query_start=(qsl - qsl[0]).to(torch.int32),
                start_pos=self._tensor([s.start_pos for s in scheduled[b:end]], torch.int32),
                kernel=self.prefill_kernel,
            )
        prefills = []
        starts = step.host_query_start_loc
        for i in range(end, len(scheduled)):
            s = scheduled[i]
            table = chunk_mask = None
            if s.start_pos > 0:
                table = step.block_tables[i, : len(s.block_table)].long()
                q_pos = torch.arange(s.start_pos, s.context_len, device=self.device)
                chunk_mask = torch.arange(s.context_len, device=self.device).unsqueeze(0) <= q_pos.unsqueeze(1)
            prefills.append(PrefillChunk(int(starts[i]), s.num_tokens, s.start_pos, table, chunk_mask))
        meta = AttentionMetadata(
            slot_mapping=step.slot_mapping,
            num_decodes=num_decode_rows,
            decode_block_tables=block_tables,
            decode_context_lens=context_lens,
            decode_mask=mask,
            prefills=tuple(prefills),
            decode_kernel=self.decode_kernel,
            kernel_chunks=chunks,
        )
        return step.input_ids, step.positions, meta

    def _forward(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(hidden [T, hidden], None) or, for a step that replayed a decode CUDA graph, (None, logits [T, vocab])."""
        if self.varlen is None:  # (decode graphs come only with a varlen backend)
            input_ids, positions, meta = self.prepare(scheduled)
            return self.model(input_ids, positions, self.kv_caches, meta), None
        step = self.input_batch.build(scheduled)
        if self.decode_graphs is not None and self.decode_graphs.can_run(step):
            return None, self.decode_graphs.run(step)
        self.varlen.plan(step)
        meta = AttentionMetadata(slot_mapping=step.slot_mapping, num_decodes=0, decode_block_tables=None, decode_context_lens=None,
                                 decode_mask=None, prefills=(), impl=self.varlen, step=step)
        return self.model(step.input_ids, step.positions, self.kv_caches, meta), None

    def _rank(self, s: ScheduledRequest) -> int:
        return kernel_rank(s, self.decode_kernel is not None, self.prefill_kernel is not None, self.batch_invariant)

    def _order(self, scheduled: Sequence[ScheduledRequest]) -> list[ScheduledRequest]:
        """A step's requests in row order (`kernel_rank`; stable)."""
        return sorted(scheduled, key=self._rank)

    @torch.inference_mode()
    def sampling_logits(self, scheduled: Sequence[ScheduledRequest]) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """Run one forward pass; return the requests that sample (decodes first) and the logits of
        their sampled positions ([rows, V]: 1 + len(spec_token_ids) consecutive rows per request)."""
        scheduled = self._order(scheduled)
        hidden, graph_logits = self._forward(scheduled)
        rows, samplers = [], []
        end = 0
        for s in scheduled:
            end += s.num_tokens
            if s.sample:
                num_rows = 1 + len(s.spec_token_ids)  # the last token and each proposed one predict a token
                rows.extend(range(end - num_rows, end))
                samplers.append(s)
        if not samplers:
            return [], torch.empty(0)
        computed = hidden if hidden is not None else graph_logits
        # rows are increasing: as many as computed means all of them (no index tensor to send over)
        picked = computed if len(rows) == computed.shape[0] else computed[self._tensor(rows)]
        return samplers, picked if hidden is None else self.model.compute_logits(picked)

    fault_hook: FaultHook | None = None  # tests only (serve_app/faults.py), installed by LLMEngine

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # constrained requests' bitmasks fill in a worker thread while the forward pass runs
        masks = self.masks.start([s for s in self._order(scheduler_output.scheduled) if s.sample])
        samplers, logits = self.sampling_logits(scheduler_output.scheduled)
        if not samplers:
            return ModelRunnerOutput((), ())
        failed: dict[str, str] = {}
        if masks is not None:
            # logprobs are of the masked distribution (as vLLM's): the grammar's forbidden tokens at -inf
            failed = masks.apply(logits)
            if failed:
                samplers, logits = self._without(samplers, logits, failed)
        out = self._sample_all(samplers, logits) if samplers else ModelRunnerOutput((), ())
        if masks is not None:
            out = replace(out, mask_s=masks.seconds, failed=out.failed + tuple(failed.items()))
        return out

    def _sample_all(self, samplers: list[ScheduledRequest], logits: torch.Tensor) -> ModelRunnerOutput:
        try:
            return self._sample(samplers, logits)
        except Exception:  # noqa: BLE001 - find whose sampling fails: only that request is aborted
            logger.warning("batched sampling failed; sampling the step's %d requests one by one", len(samplers), exc_info=True)
            return self._sample_each(samplers, logits)

    def _without(self, samplers: list[ScheduledRequest], logits: torch.Tensor, dropped: dict[str, str]):
        """The samplers not in `dropped`, with their logits rows."""
        keep, rows, at = [], [], 0
        for s in samplers:
            n = 1 + len(s.spec_token_ids)
            if s.request_id not in dropped:
                keep.append(s)
                rows.extend(range(at, at + n))
            at += n
        return keep, logits[self._tensor(rows)]

    def _sample_each(self, samplers: list[ScheduledRequest], logits: torch.Tensor) -> ModelRunnerOutput:
        """`_sample` one request at a time; the requests whose sampling raises are reported in `failed`."""
        outs: list[tuple[ScheduledRequest, ModelRunnerOutput]] = []
        failed: list[tuple[str, str]] = []
        at = 0
        for s in samplers:
            n = 1 + len(s.spec_token_ids)
            try:
                outs.append((s, self._sample([s], logits[at : at + n])))
            except Exception as exc:  # noqa: BLE001 - this request's own fault
                logger.exception("sampling failed for request %s; it is aborted", s.request_id)
                failed.append((s.request_id, f"{type(exc).__name__}: {exc}"))
            at += n
        any_logprobs = any(o.logprobs for _, o in outs)
        any_extra = any(o.extra_token_ids for _, o in outs)
        return ModelRunnerOutput(
            tuple(o.request_ids[0] for _, o in outs), tuple(o.sampled_token_ids[0] for _, o in outs),
            tuple(o.logprobs[0] if o.logprobs else None for _, o in outs) if any_logprobs else (),
            extra_token_ids=tuple(o.extra_token_ids[0] if o.extra_token_ids else () for _, o in outs) if any_extra else (),
            failed=tuple(failed))

    def _sample(self, samplers: list[ScheduledRequest], logits: torch.Tensor) -> ModelRunnerOutput:
        """Sample (and verify proposals for) `samplers` from their logits rows."""
        if self.fault_hook is not None:
            for s in samplers:
                self.fault_hook.check(Stage.SAMPLE, s.request_id)
        # one row per sampled position; a verified request's rows carry no penalties, min_tokens or
        # logprobs (`SamplingParams.can_speculate`), so the per-request inputs repeat unchanged
        spans = [1 + len(s.spec_token_ids) for s in samplers]

        def per_row(values: list) -> list:
            return [v for v, n in zip(values, spans, strict=True) for _ in range(n)]

        params = per_row([s.sampling_params for s in samplers])
        keys = [key for s in samplers for key in (s.generator_key, *s.spec_generator_keys)]
        processed = process_logits(logits, params, per_row([s.prompt_token_ids for s in samplers]),
                                   per_row([s.output_token_ids for s in samplers]), per_row([s.blocked_token_ids for s in samplers]))
        processed = apply_logit_bias(processed, params)
        token_ids = sample(processed, params, keys, self.generator, self.argmax)
        row_logprobs = ()
        if any(p.logprobs is not None for p in params):
            row_logprobs = tuple(sampled_logprobs(logits, token_ids, [p.logprobs for p in params]))
        request_ids = tuple(s.request_id for s in samplers)
        if len(token_ids) == len(samplers):
            return ModelRunnerOutput(request_ids, tuple(token_ids), row_logprobs)
        accepted, logprobs, at = [], [], 0
        for s, n in zip(samplers, spans, strict=True):
            if s.spec_draft_probs is None:
                accepted.append(accept(token_ids[at : at + n], s.spec_token_ids))
            else:
                target = sampling_probs(processed[at : at + n], params[at : at + n])
                accepted.append(rejection_sample(target, s.spec_draft_probs.to(target.device, target.dtype), s.spec_token_ids,
                                                 s.spec_accept_keys, keys[at : at + n], self.generator))
            logprobs.append(row_logprobs[at] if row_logprobs else None)
            at += n
        return ModelRunnerOutput(request_ids, tuple(a[0] for a in accepted), tuple(logprobs) if row_logprobs else (),
                                 extra_token_ids=tuple(a[1:] for a in accepted))
