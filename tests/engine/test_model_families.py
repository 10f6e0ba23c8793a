"""The Llama-family model against HF transformers on tiny random-weight checkpoints:
Llama (llama3 RoPE scaling, untied head), Qwen2 (q/k/v bias, tied), Mistral; both attention paths."""

from __future__ import annotations

import pytest
import torch

from serve_app.engine import LLM, SamplingParams

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    return {
        "llama3-rope": LlamaConfig(**COMMON, tie_word_embeddings=False, rope_theta=50000.0,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "qwen2-bias": Qwen2Config(**COMMON, tie_word_embeddings=True, rope_theta=1000000.0),
        "mistral": MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=None),
    }


@pytest.fixture(scope="module", params=["llama3-rope", "qwen2-bias", "mistral"])
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _configs()[request.param]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if request.param == "qwen2-bias":
        for layer in model.model.layers:  # random biases, not zeros, so a dropped bias would show
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, str(path)


PROMPTS = [[5, 17, 300, 42, 7], list(range(20, 90)), [511, 3], list(range(100, 133))]


def hf_tokens(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
def test_greedy_matches_hf(tiny, attention_backend):
    model, path = tiny
    llm = LLM(path, dtype="float32", attention_backend=attention_backend, block_size=8, num_blocks=64, max_num_batched_tokens=40)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert [list(o.token_ids) for o in outs] == [hf_tokens(model, p, 16) for p in PROMPTS]


def test_logits_match_hf(tiny):
    from serve_app.engine.attention import PagedAttentionMetadata

    model, path = tiny
    llm = LLM(path, dtype="float32", block_size=8, num_blocks=16)
    runner = llm.engine.core.model_runner
    prompt = PROMPTS[1]
    meta = PagedAttentionMetadata.fresh_prompt(len(prompt))
    with torch.no_grad():
        hidden = runner.model(torch.tensor(prompt), torch.arange(len(prompt)), runner.kv_caches, meta)
        ours = runner.model.compute_logits(hidden)
        ref = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
