"""Load an HF safetensors checkpoint (single file or sharded with an index) into `LlamaForCausalLM`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from serve_app.engine.models.llama import LlamaArgs, LlamaForCausalLM

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# HF name inside a layer → (our parameter, index of the slice it fills when fused)
_LAYER_MAP = {
    "self_attn.q_proj.weight": ("qkv", 0),
    "self_attn.k_proj.weight": ("qkv", 1),
    "self_attn.v_proj.weight": ("qkv", 2),
    "self_attn.q_proj.bias": ("qkv_bias", 0),
    "self_attn.k_proj.bias": ("qkv_bias", 1),
    "self_attn.v_proj.bias": ("qkv_bias", 2),
    "self_attn.o_proj.weight": ("o", None),
    "mlp.gate_proj.weight": ("gate_up", 0),
    "mlp.up_proj.weight": ("gate_up", 1),
    "mlp.down_proj.weight": ("down", None),
    "input_layernorm.weight": ("input_norm", None),
    "post_attention_layernorm.weight": ("post_norm", None),
}


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors in {model_dir}")
    return files


def _slice_bounds(args: LlamaArgs, param: str, index: int) -> tuple[int, int]:
    if param in ("qkv", "qkv_bias"):
        q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][index]
    i = args.intermediate_size
    return [(0, i), (i, 2 * i)][index]


def load_model(model_dir: str | Path, hf_config: dict[str, Any], dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    """Build the model on `device` in `dtype` and fill every parameter from the checkpoint.

    Raises ValueError if a parameter is left unfilled (a missing or unsupported checkpoint tensor).
    """
    args = LlamaArgs.from_hf(hf_config)
    with torch.device(device):
        model = LlamaForCausalLM(args).to(dtype)
    params = dict(model.named_parameters())
    filled: set[str] = set()
    for path in _checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                target, bounds = _target(args, name)
                if target is None:
                    continue
                dest = params[target]
                if bounds is None:
                    dest.copy_(tensor)
                else:
                    dest[bounds[0] : bounds[1]].copy_(tensor)
                filled.add(f"{target}:{bounds}")
    expected = _expected_keys(args)
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"model: checkpoint lacks tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model.init_rope(args.max_position_embeddings)
    return model.eval()


def _target(args: LlamaArgs, name: str) -> tuple[str | None, tuple[int, int] | None]:
    if name == "model.embed_tokens.weight":
        return "embed", None
    if name == "model.norm.weight":
        return "norm", None
    if name == "lm_head.weight":
        return (None, None) if args.tie_word_embeddings else ("lm_head", None)
    m = _LAYER.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_MAP:
        return None, None  # e.g. rotary inv_freq buffers
    param, index = _LAYER_MAP[m.group(2)]
    if param == "qkv_bias" and not args.qkv_bias:
        raise ValueError(f"model: unexpected bias tensor {name}")
    return f"layers.{m.group(1)}.{param}", None if index is None else _slice_bounds(args, param, index)


def _expected_keys(args: LlamaArgs) -> set[str]:
    keys = {"embed:None", "norm:None"}
    if not args.tie_word_embeddings:
        keys.add("lm_head:None")
    for i in range(args.num_layers):
        for param, index in _LAYER_MAP.values():
            if param == "qkv_bias" and not args.qkv_bias:
                continue
            bounds = None if index is None else _slice_bounds(args, param, index)
            keys.add(f"layers.{i}.{param}:{bounds}")
    return keys
