"""KV-cache size from a memory profile on CUDA (vLLM's `gpu_memory_utilization`).

The engine may use `utilization` × the GPU's total memory. Out of that come the weights (already
loaded), everything else on the GPU that is not this process's torch allocator (CUDA context, other
processes), and the peak activations of the largest step: a profiling forward pass over
`num_tokens` prompt tokens (the step token budget) plus logits for `num_logit_rows` rows. What is
left holds the KV cache.
"""

from __future__ import annotations

import logging

import torch

from serve_app.engine.attention import PagedAttentionMetadata

logger = logging.getLogger(__name__)


@torch.inference_mode()
def kv_cache_budget_bytes(model, utilization: float, num_tokens: int, num_logit_rows: int, block_size: int,
                          device: torch.device) -> int:
    args = model.args
    dtype = model.embed.dtype
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    not_torch = (total - free) - torch.cuda.memory_reserved(device)  # CUDA context, other processes
    # a throw-away cache just big enough for the profile's tokens (its size is taken off the peak)
    blocks = -(-num_tokens // block_size)
    shape = (blocks, block_size, args.num_kv_heads, args.head_dim)
    caches = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
              for _ in range(args.num_layers)]
    scratch_cache = sum(k.numel() * k.element_size() * 2 for k, _ in caches)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device) % args.max_position_embeddings
    hidden = model(ids, positions, caches, PagedAttentionMetadata.fresh_prompt(num_tokens, device))
    model.compute_logits(hidden[:num_logit_rows])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch_cache
    del caches, hidden
    torch.cuda.empty_cache()
    budget = int(utilization * total - not_torch - peak)
    logger.info("memory profile: GPU %.1f GiB x %.2f = %.1f GiB; weights + peak activations %.2f GiB, other %.2f GiB "
                "-> KV cache %.2f GiB", total / 2**30, utilization, utilization * total / 2**30, peak / 2**30,
                not_torch / 2**30, budget / 2**30)
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization: {utilization} leaves no memory for the KV cache "
                         f"(weights + activations {peak / 2**30:.2f} GiB, other {not_torch / 2**30:.2f} GiB)")
    return budget
