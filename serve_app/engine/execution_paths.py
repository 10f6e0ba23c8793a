"""Which implementation runs each part of a forward pass on this machine, chosen once per model runner.

Every choice the engine makes from the CPU's features can be forced through `ModelConfig`, so a test
on any machine covers every combination that machine can run, including the ones only other machines
pick by default:

- projections (`linear_backend`): the C++ AVX512-BF16 kernels, oneDNN's packed matmul (AMX where the
  CPU has it and `amx` allows it), or torch's F.linear; `auto` prefers oneDNN with AMX, else the
  kernels, else oneDNN, else dense;
- attention (`attention_backend`, attention_backends.py): decode kernel + prompt-chunk kernel, the
  decode kernel alone, or torch's SDPA;
- `batch_invariant`: projections called on row tiles measured to be row-count invariant.

`ExecutionPaths` is what was chosen, with the start-up self-check's verdict (engine/self_check.py):
logged once and exported as the labels of the `llm_engine_execution_paths` metric.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from serve_app.engine.models.row_invariance import RowTiling

logger = logging.getLogger(__name__)

# oneDNN reads it once, when it first dispatches; AVX512_CORE_BF16 is the newest ISA below AMX
NO_AMX_ISA = "AVX512_CORE_BF16"


@dataclass(frozen=True)
class ExecutionPaths:
    linear: str  # "kernels" | "onednn" | "dense"
    attention: str  # "cpu_kernel" | "cpu_decode" | "torch" | "triton" | "flashinfer"
    amx: bool  # oneDNN may use AMX tiles (the CPU has them and the config allows them)
    batch_invariant: bool  # the engine claims bit-identical results whatever the batch (see `claims_invariance`)
    row_tiles: tuple[tuple[str, RowTiling], ...] = ()  # projection -> how it is called
    self_check: str = "not run"  # "passed", "not run" (CUDA, fp32), or why it failed and what replaced it

    @property
    def labels(self) -> dict[str, str]:
        return {"linear": self.linear, "attention": self.attention, "amx": str(self.amx).lower(),
                "batch_invariant": str(self.batch_invariant).lower(), "self_check": self.self_check.split(":")[0]}

    def describe(self) -> str:
        tiles = ", ".join(f"{name} {tiling}" for name, tiling in self.row_tiles)
        return (f"projections {self.linear}{' (AMX)' if self.amx and self.linear == 'onednn' else ''}, attention {self.attention}, "
                f"batch invariant: {'yes' if self.batch_invariant else 'no'}{f' (rows per call: {tiles})' if tiles else ''}, "
                f"self-check: {self.self_check}")


def amx_supported() -> bool:
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def limit_onednn_isa(amx: bool) -> bool:
    """Keep oneDNN off AMX when `amx` is False (by its ISA limit, which it reads on its first use:
    effective in a fresh process such as a replica, not after oneDNN already ran here). Returns
    whether oneDNN may use AMX."""
    if not amx_supported():
        return False
    if not amx:
        os.environ["ONEDNN_MAX_CPU_ISA"] = NO_AMX_ISA
        return False
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return isa == "ALL" or "AMX" in isa


def resolve_linear(requested: str, device: torch.device, dtype: torch.dtype, kernels_available: bool, amx: bool) -> str:
    """The projection implementation for `ModelConfig.linear_backend` (ValueError naming the field
    when a forced one cannot run here)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        if requested not in ("auto", "dense"):
            raise ValueError(f"linear_backend: {requested} is for bf16 on CPU")
        return "dense"
    onednn = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if requested == "kernels" and not kernels_available:
        raise ValueError("linear_backend: kernels need a CPU with AVX512-BF16 (and the C++ ops built)")
    if requested == "onednn" and not onednn:
        raise ValueError("linear_backend: onednn needs oneDNN bf16 support (AVX512)")
    if requested != "auto":
        return requested
    if amx and onednn:
        return "onednn"
    return "kernels" if kernels_available else ("onednn" if onednn else "dense")
