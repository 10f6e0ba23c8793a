"""Load an HF safetensors checkpoint (single file or sharded with an index) into `LlamaForCausalLM`.

Strict: every checkpoint tensor must map onto a parameter of the model as configured, and every
parameter must be filled. A tensor the model would ignore (an `o_proj.bias`, MLP biases, an
`lm_head` that differs from the tied embedding) means the checkpoint computes something this model
does not, so loading it would produce wrong text: it is refused with a ValueError instead.
The model is built directly in its target dtype on its target device (on the meta device first,
so no fp32 copy is ever allocated); each checkpoint tensor is read from the memory-mapped file and
copied into place.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from serve_app.engine.models.llama import LlamaArgs, LlamaForCausalLM

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# buffers some checkpoints carry that hold nothing the model needs (recomputed from the config)
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")
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
    with torch.device("meta"):
        model = LlamaForCausalLM(args).to(dtype)
    model = model.to_empty(device=device)  # uninitialized: every parameter is filled below (or we raise)
    params = dict(model.named_parameters())
    filled: set[str] = set()
    tied_head: torch.Tensor | None = None
    for path in _checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if _IGNORED.fullmatch(name):
                    continue
                tensor = f.get_tensor(name)
                if name == "lm_head.weight" and args.tie_word_embeddings:
                    tied_head = tensor  # must equal the embedding: checked once that is loaded
                    continue
                target, bounds = _target(args, name)
                dest = params[target]
                expected_shape = dest.shape if bounds is None else (bounds[1] - bounds[0], *dest.shape[1:])
                if tuple(tensor.shape) != tuple(expected_shape):
                    raise ValueError(f"model: tensor {name} has shape {tuple(tensor.shape)}, the config implies {tuple(expected_shape)}")
                if bounds is None:
                    dest.copy_(tensor)
                else:
                    dest[bounds[0] : bounds[1]].copy_(tensor)
                filled.add(f"{target}:{bounds}")
    expected = _expected_keys(args)
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"model: checkpoint lacks tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if tied_head is not None and not torch.equal(tied_head.to(dtype), model.embed.data.cpu()):
        raise ValueError("model: tie_word_embeddings is true but lm_head.weight differs from embed_tokens.weight")
    model.init_rope(args.max_position_embeddings)
    return model.eval()


def _target(args: LlamaArgs, name: str) -> tuple[str, tuple[int, int] | None]:
    """Our parameter (and the rows it fills) for a checkpoint tensor; ValueError if there is none."""
    if name == "model.embed_tokens.weight":
        return "embed", None
    if name == "model.norm.weight":
        return "norm", None
    if name == "lm_head.weight":
        return "lm_head", None
    m = _LAYER.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_MAP or int(m.group(1)) >= args.num_layers:
        raise ValueError(f"model: checkpoint tensor {name} is not supported by this model (config: {args.num_layers} "
                         "layers, Llama-family tensors without o_proj or MLP biases)")
    param, index = _LAYER_MAP[m.group(2)]
    if param == "qkv_bias" and not args.qkv_bias:
        raise ValueError(f"model: checkpoint tensor {name} is a bias the config does not declare (attention_bias)")
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
