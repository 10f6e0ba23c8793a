"""Llama-family decoder (Llama, SmolLM, Qwen2, Mistral) over a flattened token batch and a paged KV cache.

Differences between the families are config-driven: grouped-query attention (num_key_value_heads),
q/k/v bias (Qwen2), tied embeddings, RoPE theta and scaling (default, linear, llama3).
q/k/v and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from serve_app.engine.attention import AttentionMetadata, PagedAttentionMetadata, paged_attention
from serve_app.engine.models.row_invariance import UNTILED, Projection, RowTiling, invariant_tiling, row_tiled

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaArgs:
        archs = cfg.get("architectures") or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(f"model: architecture {archs} is not supported (supported: {SUPPORTED_ARCHITECTURES})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"model: hidden_act {cfg['hidden_act']!r} is not supported")
        if cfg.get("mlp_bias"):
            raise ValueError("model: mlp_bias is not supported")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        heads = cfg["num_attention_heads"]
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias="Qwen2ForCausalLM" in archs or cfg.get("attention_bias", False),
            sliding_window=window,
        )


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, with HF's scaling rules."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"model: rope scaling {kind!r} is not supported")


def linear_rows_bucket(num_rows: int) -> int:
    """The row count a packed matmul runs at: exact up to 8, then a multiple of 8 up to 64, then of 64.

    oneDNN builds (and caches, up to 1024 per process) a primitive for every input shape. A serving
    engine sees nearly every token count up to its step budget, so the cache would fill with ~0.5 MB
    primitives (a replica's RSS grew by ~0.5 GB before it stopped) and keep building new ones. Padded
    to these buckets there are at most 8 + 7 + budget / 64 shapes per projection; the extra rows cost
    little (under 64 tokens of a long prefill; small matmuls are bound by reading the weight)."""
    if num_rows <= 8:
        return num_rows
    step = 8 if num_rows <= 64 else 64
    return -(-num_rows // step) * step


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a weight packed by `torch.ops.mkldnn._reorder_linear_weight`, the rows padded to
    `linear_rows_bucket` (each output row depends on its input row only)."""
    rows = x.shape[0]
    padded = linear_rows_bucket(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _packed_fp32_logits(x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """fp32 logits [M, V] from bf16 hidden states and a head packed by oneDNN in fp32."""
    return _packed_linear(x.float(), head)


def _dense_logits(x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    return F.linear(x, head).float()


class LlamaLayer(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        h, q, kv = args.hidden_size, args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.input_norm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.qkv = nn.Parameter(torch.empty(q + 2 * kv, h), requires_grad=False)
        self.qkv_bias = nn.Parameter(torch.zeros(q + 2 * kv), requires_grad=False) if args.qkv_bias else None
        self.o = nn.Parameter(torch.empty(h, q), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(h), requires_grad=False)
        self.gate_up = nn.Parameter(torch.empty(2 * args.intermediate_size, h), requires_grad=False)
        self.down = nn.Parameter(torch.empty(h, args.intermediate_size), requires_grad=False)


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Parameter(torch.empty(args.vocab_size, args.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(LlamaLayer(args) for _ in range(args.num_layers))
        self.norm = nn.Parameter(torch.ones(args.hidden_size), requires_grad=False)
        self.lm_head = None if args.tie_word_embeddings else nn.Parameter(torch.empty(args.vocab_size, args.hidden_size), requires_grad=False)
        self.scale = args.head_dim**-0.5
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        # projection name -> (x, weight[, bias]) -> y, for the weights as `configure_projections` left them;
        # "gate_up" gives silu(gate) * up directly where a kernel fuses it (`_silu_mul_linear`)
        self._linears: dict[str, object] = dict.fromkeys(("qkv", "o", "gate_up", "down"), F.linear)
        self._silu_mul_linear = False
        self._lm_head_packed: torch.Tensor | None = None  # the lm_head as `_logits_linear` reads it
        self._logits_linear = _dense_logits  # (x, head) -> fp32 logits
        self._rms_norm_op = None  # (x, weight, eps) -> normed, replacing F.rms_norm (bf16 CPU op)
        self._add_rms_norm_op = None  # (x, residual, weight, eps) -> normed, residual += x in place (bf16 CPU op)
        self._rope_write_kv_op = None  # RoPE on q/k in place + k/v to the cache (bf16 CPU op, csrc/rope_kv.cpp)

    def use_rms_norm_op(self, op) -> None:
        """Normalize with `op(x, weight, eps)` (e.g. the C++ bf16 CPU op) instead of F.rms_norm."""
        self._rms_norm_op = op

    def use_add_rms_norm_op(self, op) -> None:
        """Add to the residual and normalize with `op(x, residual, weight, eps)` (the C++ bf16 CPU op,
        which updates `residual` in place); same results as the add and the norm apart."""
        self._add_rms_norm_op = op

    def use_rope_write_kv_op(self, op) -> None:
        """Rotate q/k and write k/v to the cache with `op` (the C++ bf16 CPU op) instead of torch's
        gather, roll, elementwise ops and index_copy_; bit-identical. Only for steps attended layer by
        layer (`PagedAttentionMetadata`): a whole-step implementation writes the cache itself."""
        self._rope_write_kv_op = op

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); the fused op updates `residual` in place."""
        if self._add_rms_norm_op is not None:
            return self._add_rms_norm_op(x, residual, weight, self.args.rms_norm_eps), residual
        residual = residual + x
        return self._norm(residual, weight), residual

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._rms_norm_op is not None:
            return self._rms_norm_op(x, weight, self.args.rms_norm_eps)
        return F.rms_norm(x, (self.args.hidden_size,), weight, self.args.rms_norm_eps)

    def configure_projections(self, kind: str, kernels=None, invariant: bool = False, max_rows: int = 2048,
                              max_logit_rows: int = 256) -> dict[str, RowTiling]:
        """Choose how the projections run from now on (on CPU; elsewhere only "dense" exists) and put
        their weights in that layout once. Returns how each projection is called (its row tiling).

        - "kernels" (`cpu_kernels.LinearKernels`, the C++ AVX512-BF16 kernels): their own layout, the
          gate/up halves interleaved so that SiLU·mul runs in the matmul's epilogue. Within one bf16
          ulp of F.linear (another summation order); the epilogues round as torch's ops.
        - "onednn": oneDNN's packed layout (`torch.ops.mkldnn._reorder_linear_weight`; AMX where the
          CPU has it), rows padded to `linear_rows_bucket`, bit-identical to F.linear.
        - "dense": torch's F.linear on the weights as loaded.
        Logits are fp32 on every path: the C++ lm_head kernel's accumulators where the kernels exist
        (whatever runs the other projections), else oneDNN's fp32 matmul over an fp32 copy of the head.
        With `invariant`, each projection is measured (`row_invariance.invariant_tiling`) up to
        `max_rows` rows (`max_logit_rows` for the lm_head) and called on row tiles it is invariant at.
        """
        head = self.embed if self.lm_head is None else self.lm_head
        cpu_bf16 = self.embed.device.type == "cpu" and self.embed.dtype == torch.bfloat16
        names = ("qkv", "o", "gate_up", "down")
        dense = Projection("dense", F.linear, lambda w: w)
        projections = dict.fromkeys(names, dense)
        if kind == "kernels":
            projections = dict.fromkeys(names, Projection("kernels", kernels.linear, kernels.pack))
            projections["gate_up"] = Projection("kernels-silu-mul", kernels.silu_mul, lambda w: kernels.pack(w, interleave=True))
        elif kind == "onednn":
            projections = dict.fromkeys(names, Projection("onednn", _packed_linear, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None)))
        elif kind != "dense":
            raise ValueError(f"linear_backend: unknown {kind!r}")
        if cpu_bf16 and kernels is not None:
            logits = Projection("kernels-logits", kernels.logits, kernels.pack)
        elif cpu_bf16:  # fp32 logits without the C++ kernels: oneDNN's fp32 matmul (row-invariant, unlike MKL's)
            logits = Projection("onednn-fp32-logits", _packed_fp32_logits,
                                lambda w: torch.ops.mkldnn._reorder_linear_weight(w.float(), None))
        else:
            logits = Projection("dense-logits", _dense_logits, lambda w: w)
        for layer in self.layers:
            for name in names:
                setattr(layer, name, nn.Parameter(projections[name].pack(getattr(layer, name).data), requires_grad=False))
        self._silu_mul_linear = kind == "kernels"
        self._lm_head_packed = logits.pack(head.data)
        tiles = dict.fromkeys((*names, "lm_head"), UNTILED)
        if invariant:
            a = self.args
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            shapes = {"qkv": (q + 2 * kv, a.hidden_size), "o": (a.hidden_size, q), "gate_up": (2 * a.intermediate_size, a.hidden_size),
                      "down": (a.hidden_size, a.intermediate_size), "lm_head": (a.vocab_size, a.hidden_size)}
            for name in names:
                tiles[name] = invariant_tiling(projections[name], *shapes[name], self.embed.dtype, max_rows)
            tiles["lm_head"] = invariant_tiling(logits, *shapes["lm_head"], self.embed.dtype, max_logit_rows)
        self._linears = {name: row_tiled(projections[name].fn, tiles[name]) for name in names}
        self._logits_linear = row_tiled(logits.fn, tiles["lm_head"])
        return tiles

    def init_rope(self, max_positions: int) -> None:
        """cos/sin tables [max_positions, head_dim] in the model dtype (computed in fp32, as HF does)."""
        inv_freq = rope_inv_freq(self.args).to(self.embed.device)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=self.embed.device), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos().to(self.embed.dtype)
        # sin with the sign of rotate_half folded in: rotate_half(x) * sin == roll(x, D/2) * signed_sin
        half = emb.shape[-1] // 2
        self._sin = torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1).to(self.embed.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """HF's `x * cos + rotate_half(x) * sin`, rounded the same way, in four ops."""
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] before the final norm."""
        a = self.args
        num_tokens = input_ids.shape[0]
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        fused_rope = self._rope_write_kv_op is not None and isinstance(meta, PagedAttentionMetadata)
        if not fused_rope:
            cos = self._cos[positions].unsqueeze(1)  # [T, 1, D]
            sin = self._sin[positions].unsqueeze(1)
        hidden = F.embedding(input_ids, self.embed)  # [T, hidden]
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            if residual is None:
                residual, x = hidden, self._norm(hidden, layer.input_norm)
            else:  # the previous layer's MLP output joins the residual stream here
                x, residual = self._add_norm(hidden, residual, layer.input_norm)
            qkv = self._linears["qkv"](x, layer.qkv, layer.qkv_bias)  # [T, q + 2 kv]
            if fused_rope:  # q and k rotated in place, k and v already in the cache
                self._rope_write_kv_op(qkv, positions, self._cos, self._sin, k_cache, v_cache, meta.slot_mapping,
                                       a.num_heads, a.num_kv_heads)
                heads = qkv.view(num_tokens, a.num_heads + 2 * a.num_kv_heads, a.head_dim)
                q, k = heads[:, : a.num_heads], heads[:, a.num_heads : a.num_heads + a.num_kv_heads]
            else:  # q and k heads rotate together (one set of ops for both)
                qk = self._rope(qkv[:, : q_size + kv_size].view(num_tokens, a.num_heads + a.num_kv_heads, a.head_dim), cos, sin)
                q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
            v = qkv[:, q_size + kv_size :].view(num_tokens, a.num_kv_heads, a.head_dim)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, kv_written=fused_rope)  # [T, H, D]
            x, residual = self._add_norm(self._linears["o"](attn.view(num_tokens, q_size), layer.o), residual, layer.post_norm)
            if self._silu_mul_linear:
                act = self._linears["gate_up"](x, layer.gate_up)
            else:
                gate, up = self._linears["gate_up"](x, layer.gate_up).chunk(2, dim=-1)
                act = F.silu(gate) * up
            hidden = self._linears["down"](act, layer.down)
        return residual + hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] → fp32 logits [S, vocab]."""
        x = self._norm(hidden, self.norm)
        head = self._lm_head_packed
        if head is None:
            head = self.embed if self.lm_head is None else self.lm_head
        return self._logits_linear(x, head)
