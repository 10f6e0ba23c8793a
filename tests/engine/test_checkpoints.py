"""Real-model behaviour on other architectures (random weights, own tokenizer), token-exact vs HF:
every EOS id of config.json and generation_config.json ends generation, generation_config.json's
sampling defaults apply, text prompts get the tokenizer's own special tokens (a Llama-3 BOS), and
the loader refuses checkpoints it cannot compute faithfully."""

from __future__ import annotations

import json

import pytest
import torch

from serve_app.engine import LLM, SamplingParams
from tests.engine import tiny_checkpoints as tc

TEXT_PROMPTS = ["w1 w2 w3 w4", "w10 w200 w7", "w42 w43 w44 w45 w46 w47 w48 w49 w50"]
MAX_TOKENS = 20


def hf_generate(model, ids: list[int]) -> list[int]:
    """HF greedy continuation, stopping at the model's generation_config EOS ids (included)."""
    return hf_generate_n(model, ids, MAX_TOKENS, stop_at_eos=True)


def hf_generate_n(model, ids: list[int], n: int, stop_at_eos: bool = False) -> list[int]:
    # an explicit attention mask: else HF masks prompt tokens that equal the pad id (SmolLM2's <|im_end|>)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=None if stop_at_eos else n,
                             do_sample=False, pad_token_id=tc.END_OF_TEXT)
    return out[0, len(ids):].tolist()


def eos_candidate(tokens: list[int], exclude: set[int]) -> tuple[int, int]:
    """A token first generated at position >= 3: (token, position); as an EOS id it stops mid-output."""
    for pos, t in enumerate(tokens):
        if pos >= 3 and t not in tokens[:pos] and t not in exclude:
            return t, pos
    raise AssertionError(f"no usable EOS candidate in {tokens}")


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """Llama-3-style checkpoint whose generation_config.json adds a third EOS id, one the model
    really generates for the first prompt, and Llama-3's sampling defaults."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tc.build(tc.llama3_config())
    path = tmp_path_factory.mktemp("llama3")
    tc.save_tokenizer(path, add_bos=True)
    tok = AutoTokenizer.from_pretrained(path)
    free = hf_generate_n(model, tok(TEXT_PROMPTS[0])["input_ids"], MAX_TOKENS)
    extra_eos, pos = eos_candidate(free, {tc.END_OF_TEXT, tc.EOT})
    tc.save(model, path, add_bos=True, generation={"eos_token_id": [tc.END_OF_TEXT, tc.EOT, extra_eos], "do_sample": True,
                                                   "temperature": 0.6, "top_p": 0.9})
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return reloaded, tok, str(path), extra_eos, pos


def test_llama3_text_prompts_get_bos_and_stop_at_every_eos_id(llama3):
    model, tok, path, extra_eos, pos = llama3
    llm = LLM(path, dtype="float32", block_size=8, num_blocks=64)
    assert llm.engine.input_processor.eos_token_ids == {tc.END_OF_TEXT, tc.EOT, extra_eos}
    outs = llm.generate(TEXT_PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, out in zip(TEXT_PROMPTS, outs, strict=True):
        ids = tok(prompt)["input_ids"]
        assert ids[0] == tc.BOS
        assert list(out.prompt_token_ids) == ids
        assert list(out.token_ids) == hf_generate(model, ids)
    first = outs[0]
    assert len(first.token_ids) == pos + 1 and first.token_ids[-1] == extra_eos and first.finish_reason == "stop"


def test_generation_config_sampling_defaults(llama3):
    _, _, path, _, _ = llama3
    llm = LLM(path, dtype="float32", block_size=8, num_blocks=16)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.9, 0)  # top_k: not in the file, so off


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tc.build(tc.qwen2_config())
    path = tmp_path_factory.mktemp("qwen2")
    tc.save(model, path)
    tc.copy_tokenizer(model_dir, path)
    tok = AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    free = hf_generate_n(model, ids, MAX_TOKENS)
    eos, pos = eos_candidate(free, set())
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    tc.save(model, path)
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return reloaded, tok, str(path), chat, ids, pos


def test_qwen2_chat_and_text_match_hf(qwen2):
    model, tok, path, chat, chat_ids, pos = qwen2
    llm = LLM(path, dtype="float32", block_size=8, num_blocks=64)
    (out,) = llm.chat([chat], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert list(out.prompt_token_ids) == chat_ids
    assert list(out.token_ids) == hf_generate(model, chat_ids)
    assert len(out.token_ids) == pos + 1 and out.finish_reason == "stop"
    outs = llm.generate(TEXT_PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, o in zip(TEXT_PROMPTS, outs, strict=True):
        ids = tok(prompt)["input_ids"]
        assert ids == tok(prompt, add_special_tokens=False)["input_ids"]  # this tokenizer adds no special tokens
        assert list(o.prompt_token_ids) == ids
        assert list(o.token_ids) == hf_generate(model, ids)


# ---- the loader refuses what it cannot compute -----------------------------------------------------


def _edit_config(path, **changes) -> None:
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))


def _add_tensor(path, name: str, tensor: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors[name] = tensor
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("case", ["o_proj_bias", "mlp_bias", "tied_but_different_head", "untied_without_head", "unknown_tensor"])
def test_loader_refuses_checkpoints_it_would_misread(tmp_path, case):
    if case == "o_proj_bias":  # Llama's attention_bias: q/k/v *and* o_proj biases
        model, match = tc.build(tc.llama3_config(attention_bias=True)), "o_proj.bias"
    elif case == "mlp_bias":
        model, match = tc.build(tc.llama3_config(mlp_bias=True)), "mlp_bias"
    else:
        model = tc.build(tc.llama3_config())
        match = {"tied_but_different_head": "lm_head", "untied_without_head": "lm_head", "unknown_tensor": "q_norm"}[case]
    tc.save(model, tmp_path, add_bos=True)
    if case == "tied_but_different_head":
        _edit_config(tmp_path, tie_word_embeddings=True)
    elif case == "untied_without_head":
        tied = tc.build(tc.llama3_config(tie_word_embeddings=True))  # saved without lm_head.weight
        tc.save(tied, tmp_path, add_bos=True)
        _edit_config(tmp_path, tie_word_embeddings=False)
    elif case == "unknown_tensor":  # e.g. a Qwen3 checkpoint's q/k norms
        _add_tensor(tmp_path, "model.layers.0.self_attn.q_norm.weight", torch.ones(16))
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), dtype="float32", block_size=8, num_blocks=8)


def test_loader_accepts_a_tied_head_saved_alongside_the_embedding(tmp_path):
    model = tc.build(tc.llama3_config(tie_word_embeddings=True))
    tc.save(model, tmp_path, add_bos=True)
    _add_tensor(tmp_path, "lm_head.weight", model.model.embed_tokens.weight.detach().clone())
    llm = LLM(str(tmp_path), dtype="float32", block_size=8, num_blocks=8)
    out = llm.generate([[7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert list(out.token_ids) == hf_generate_n(model, [7, 8, 9], 4)

