"""W1's FLOP count (loadtest/compute_floor.py) against an independent count: 2 x the weights of the
HF model's linear layers per token, plus attention's 4 x context x heads x head_dim per layer."""

from __future__ import annotations

import torch

from loadtest.compute_floor import matmul_rate, w1_flops

CFG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "tie_word_embeddings": True}


def test_w1_flops_match_the_models_linear_layers():
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**{k: v for k, v in CFG.items() if k != "architectures"}))
    body = sum(m.weight.numel() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head")
    head = model.lm_head.weight.numel()
    attn = 4 * 3 * 4 * 16  # per (query, key) pair: layers x heads x head_dim x 4
    n, p, o = 2, 5, 3
    flops = w1_flops(CFG, n, p, o)
    assert flops["prefill_flops"] == n * (p * 2 * body + 2 * head + attn * sum(range(1, p + 1)))
    assert flops["decode_flops"] == n * ((o - 1) * (2 * body + 2 * head) + attn * sum(p + i for i in range(1, o)))


def test_matmul_rate_runs_the_engines_matmul():  # oneDNN with packed bf16 weights where the CPU has it
    rate = matmul_rate(CFG, 8, "bfloat16", "cpu", repeats=1)
    assert 0 < rate < float("inf")
