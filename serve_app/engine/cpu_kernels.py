"""CPU ops in C++ (csrc/), built once per machine with torch's extension builder.

- `paged_decode` (csrc/paged_decode.cpp, whose header explains its loops): decode attention read in
  place from the block tables. The reference path (gather the blocks, then
  `scaled_dot_product_attention`) copies every decode request's whole context each layer and runs
  thousands of tiny attention problems. fp32 accumulation.
- `paged_prefill` (csrc/paged_prefill.cpp): causal attention for a step's prompt chunks read in place
  from the block tables, 16 query tokens per task (bf16 with AVX512-BF16, head_dim 64 or 128:
  `paged_prefill_supported(head_dim)`; the runner otherwise gives the chunks to `paged_decode` as rows).
- `rms_norm_bf16` (csrc/rms_norm.cpp): one pass per row instead of torch's chain of ops, with HF's
  rounding.
- `add_rms_norm_bf16` (csrc/fused_ops.cpp): residual add + RMSNorm in one pass (the residual
  updated in place), bit-identical to the pair it replaces.
- `rope_write_kv_bf16` (csrc/rope_kv.cpp): RoPE on a layer's q and k heads in place and the k/v rows
  written to their cache slots, one pass per token, bit-identical to the torch ops it replaces.
- `argmax_rows` (csrc/argmax.cpp): greedy sampling's argmax over fp32 logits at memory speed,
  with torch.argmax's answer (first maximum; first NaN).
- `linear_bf16`, `linear_silu_mul_bf16`, `linear_logits_bf16` (csrc/linear_bf16.cpp): the bf16
  projections over weights in their own packed layout (AVX512-BF16), SiLU·mul fused into the gate/up
  matmul and fp32 logits out of the lm_head; within one bf16 ulp of F.linear (another summation
  order), the epilogues rounding as torch's ops do; `linear_kernels()` bundles them where they beat
  oneDNN.

`op(name)` returns one of them by name, or None (with a warning, once) when the
extension cannot be built; callers then use the torch path. `python -m serve_app.engine.cpu_kernels`
builds it ahead of time (make install does).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.cpp"))


@functools.cache
def _extension() -> Any | None:
    """Build (or load the cached build of) the extension; None if that fails."""
    try:
        import torch
        from torch.utils.cpp_extension import load

        # the name carries a hash of the sources, of their directory and of the torch installation:
        # checkouts with other kernels, other checkouts of the same kernels and environments with
        # another torch never share a build directory (build.ninja names the source paths and torch's
        # include path, so a shared one would be rebuilt by each in turn), so a built extension is
        # only loaded
        identity = b"".join(p.read_bytes() for p in _SOURCES) + str(_SOURCES[0].parent.resolve()).encode() + torch.__file__.encode()
        digest = hashlib.sha256(identity).hexdigest()[:12]
        # a cold build runs one compiler at a time: each holds ~1.1 GB resident (torch's headers),
        # and in parallel they were most of the engine's peak memory at start-up
        os.environ.setdefault("MAX_JOBS", "1")
        return load(
            name=f"serve_app_cpu_ops_{digest}",
            sources=[str(p) for p in _SOURCES],
            # fast-math for vectorized exp (glibc libmvec); finite-math off to keep inf/nan semantics
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"],
            extra_ldflags=["-fopenmp"],
            verbose=bool(os.environ.get("SERVE_APP_VERBOSE_BUILD")),
        )
    except Exception as exc:  # no compiler, no ninja, ...: the torch paths still work
        logger.warning("CPU C++ ops unavailable (%s); using the torch reference paths", exc)
        return None


def op(name: str) -> Any | None:
    """The extension's op `name` (`paged_decode`, `rms_norm_bf16`, ...), or None without the extension."""
    ext = _extension()
    return None if ext is None else getattr(ext, name)


@dataclass(frozen=True)
class LinearKernels:
    """The C++ bf16 projection kernels (csrc/linear_bf16.cpp), as `LlamaForCausalLM.configure_projections` uses them."""

    pack: Callable  # (w [N, K], interleave=False) -> packed
    linear: Callable  # (x [M, K], packed, bias=None) -> [M, N] bf16
    silu_mul: Callable  # (x, packed gate/up, interleaved) -> silu(gate) * up [M, N / 2] bf16
    logits: Callable  # (x, packed lm_head) -> [M, N] fp32 accumulators (never rounded to bf16)


def linear_kernels(out_features: list[int], in_features: list[int]) -> LinearKernels | None:
    """The kernels where they run: built with AVX512-BF16, and every projection's shape fits their
    layout (N a multiple of 32, K even). None otherwise. (On a CPU with AMX they still compute the
    lm_head's fp32 logits; oneDNN's AMX kernels run the other projections several times faster.)"""
    supported = op("linear_bf16_supported")
    if supported is None or not supported():
        return None
    if any(n % 32 for n in out_features) or any(k % 2 for k in in_features):
        return None
    return LinearKernels(op("pack_linear_bf16"), op("linear_bf16"), op("linear_silu_mul_bf16"), op("linear_logits_bf16"))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("[kernel] building the CPU C++ ops (about a minute the first time) ...", flush=True)
    print("[kernel] ready" if _extension() is not None else "[kernel] unavailable: the torch paths will be used")
