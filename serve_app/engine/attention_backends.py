"""Which attention implementation a model runner uses, from `ModelConfig.attention_backend`.

- cpu: `auto` is the C++ decode kernel plus, where it runs, the prompt-chunk kernel (`cpu_kernel`);
  `cpu_decode` is the decode kernel for every row, prompt tokens included; `triton` runs the Triton kernels under
  the interpreter (TRITON_INTERPRET=1; for tests only: slow); `flashinfer` is an error.
- cuda: `auto` is FlashInfer when `flashinfer` imports and the dtype is 16-bit (FlashInfer has no
  fp32 kernels), else Triton, else the reference path; `torch` is the reference path (gathers
  blocks; SDPA). A package that is installed but fails to import (e.g. a wheel copied over without
  its dependencies) counts as absent for `auto`, with a warning; requested by name, it is an error.
Returns "torch", "cpu_kernel", "cpu_decode", "triton" or "flashinfer".
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os

import torch

logger = logging.getLogger(__name__)


def _importable(name: str) -> bool:
    if importlib.util.find_spec(name) is None:
        return False
    try:
        importlib.import_module(name)
    except Exception as exc:  # whatever a broken install raises (ImportError, OSError for a missing .so, ...)
        logger.warning("attention_backend auto: %s is installed but does not import (%r); not using it", name, exc)
        return False
    return True


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    if requested == "torch":
        return "torch"
    if device.type == "cpu":
        if requested == "flashinfer":
            raise ValueError("attention_backend: flashinfer needs a CUDA device")
        if requested == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend: triton on a CPU needs TRITON_INTERPRET=1 (Triton's interpreter; tests only)")
        return {"triton": "triton", "cpu_decode": "cpu_decode"}.get(requested, "cpu_kernel")
    if requested == "cpu_decode":
        raise ValueError("attention_backend: cpu_decode needs a CPU device")
    if requested in ("triton", "flashinfer"):
        if importlib.util.find_spec(requested) is None:
            raise ValueError(f"attention_backend: {requested} is not installed")
        if requested == "flashinfer" and dtype == torch.float32:
            raise ValueError("attention_backend: flashinfer has no float32 kernels (use bfloat16/float16, or triton)")
        return requested
    candidates = ("triton",) if dtype == torch.float32 else ("flashinfer", "triton")
    return next((name for name in candidates if _importable(name)), "torch")


def make_varlen_attention(backend: str, args, block_size: int, dtype: torch.dtype, device: torch.device):
    """The whole-step implementation (with `plan(step)` and a per-layer call) for triton / flashinfer."""
    if backend == "triton":
        from serve_app.engine.attention_triton import TritonAttention

        return TritonAttention()
    from serve_app.engine.attention_flashinfer import FlashInferAttention

    return FlashInferAttention(args.num_heads, args.num_kv_heads, args.head_dim, block_size, dtype, args.head_dim**-0.5, device)
