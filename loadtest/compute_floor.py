"""The compute floor of a W1 run (docs/benchmarks.md): its FLOPs (multiply-adds count 2; every token through the
projections and attending over its context, 4 x context x heads x head_dim per layer; the lm_head once per sampled
token) at the machine's best measured rate (oneDNN with packed weights or the engine's C++ kernels on CPU in bf16) of
a `prefill_rows`-row matmul for prefill tokens, a `decode_rows`-row one for decode tokens and attention alike, so no
engine can beat it. `Floor` runs in a worker process, measured right before every W1 run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def _shapes(cfg: dict[str, Any]) -> list[tuple[int, int]]:
    """(in, out) features of one layer's projections (qkv, o, gate_up, down), then of the lm_head."""
    hidden, heads, inter = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, (cfg.get("num_key_value_heads") or heads) * head_dim
    return [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden), (hidden, cfg["vocab_size"])]


def w1_flops(cfg: dict[str, Any], num_requests: int, prompt_len: int, output_len: int) -> dict[str, float]:
    *layer, (hidden, vocab) = _shapes(cfg)
    # the projections' FLOPs per token, the lm_head's per sampled row, attention's per (query, key) pair
    layers = cfg["num_hidden_layers"]
    per_token, head, attn_per_ctx = 2 * layers * sum(k * n for k, n in layer), 2 * hidden * vocab, 4 * layers * layer[1][0]
    # the prompt token at position p attends over p + 1 keys; decode step i (1-based) feeds the token at
    # position prompt_len + i - 1, which attends over prompt_len + i keys
    prefill = num_requests * (prompt_len * per_token + head + attn_per_ctx * prompt_len * (prompt_len + 1) / 2)
    decodes = output_len - 1
    decode = num_requests * (decodes * (per_token + head) + attn_per_ctx * sum(prompt_len + i for i in range(1, decodes + 1)))
    return {"prefill_flops": prefill, "decode_flops": decode}


def sync(device: Any) -> None:
    """Wait for the work queued on `device` (a CUDA device; nothing to wait for elsewhere)."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def matmul_rate(cfg: dict[str, Any], rows: int, dtype_name: str, device: str, repeats: int = 5, with_head: bool = True) -> float:
    """FLOP/s of one pass over the model's projection shapes (one layer, + the lm_head when
    `with_head`: decode steps run it on every row, prefill steps on one row per prompt) at `rows` rows."""
    import torch
    import torch.nn.functional as F

    dtype, shapes = getattr(torch, dtype_name), _shapes(cfg)[:None if with_head else -1]
    mats = [(torch.randn(rows, k, device=device).to(dtype), torch.randn(n, k, device=device).to(dtype)) for k, n in shapes]
    flops, linears = sum(2 * rows * k * n for k, n in shapes), {"torch": (F.linear, mats)}
    if device == "cpu" and dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # oneDNN with weights packed once (faster than F.linear's per-call packing)
        linears = {"onednn": (lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                              [(x, torch.ops.mkldnn._reorder_linear_weight(w, None)) for x, w in mats])}
        from serve_app.engine import cpu_kernels

        kernels = cpu_kernels.linear_kernels([n for _, n in shapes], [k for k, _ in shapes])
        if kernels is not None:  # and the engine's own kernels where it runs them: the floor takes the faster
            linears["kernels"] = (kernels.linear, [(x, kernels.pack(w)) for x, w in mats])

    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first pass warms up; implementations alternate
            for linear, packed in linears.values():
                sync(device)
                t0 = time.perf_counter()
                for x, w in packed:
                    linear(x, w)
                sync(device)
                best = min(best, time.perf_counter() - t0)
    return flops / best


class Floor:
    """The compute floor of the W1 run `opts` describes, measured anew on every `measure()`."""

    def __init__(self, opts: dict[str, Any]) -> None:
        import torch

        if opts.get("threads"):
            torch.set_num_threads(opts["threads"])
        self.opts, self.cfg = opts, json.loads((Path(opts["model"]) / "config.json").read_text())

    def measure(self) -> dict[str, Any]:
        """The run's FLOPs, the two rates, the floor time and output tok/s."""
        o, cfg = self.opts, self.cfg
        flops = w1_flops(cfg, o["num_requests"], o["prompt_len"], o["output_len"])
        decode_rows, prefill_rows = min(o["num_requests"], o["max_num_seqs"]), min(o["num_requests"] * o["prompt_len"], o["max_num_batched_tokens"])
        decode_rate = matmul_rate(cfg, decode_rows, o["dtype"], o["device"])
        prefill_rate = matmul_rate(cfg, prefill_rows, o["dtype"], o["device"], with_head=False)
        floor_s = flops["prefill_flops"] / prefill_rate + flops["decode_flops"] / decode_rate
        return {**flops, "decode_rows": decode_rows, "prefill_rows": prefill_rows, "decode_tflop_s": decode_rate / 1e12,
                "prefill_tflop_s": prefill_rate / 1e12, "floor_s": floor_s, "floor_output_tok_s": o["num_requests"] * o["output_len"] / floor_s}
