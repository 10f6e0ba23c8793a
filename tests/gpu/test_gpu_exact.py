"""GPU readiness: the native engine on cuda against HF transformers on cuda, same real model.

fp32: greedy output must be token-exact on chat-templated prompts of different lengths, all
submitted together, with chunked prefill forced, and with a KV cache small enough to force
preemption. bf16: a sanity check (first tokens agree, the smoke prompt answers "Paris").

Marked `gpu` (the default suite deselects it) and skipped without CUDA. Run with
`pytest -m gpu tests/gpu` (loadtest/gpu_check.sh does). `GPU_TEST_DEVICE=cpu` runs the same checks
on the CPU (slow; for checking this file without a GPU). `GPU_TEST_MODEL` overrides the model directory
(the random-weight stand-in loadtest/gpu_check.sh makes without the weights skips the bf16 text check).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

DEVICE = os.environ.get("GPU_TEST_DEVICE", "cuda")
MODEL_DIR = Path(os.environ.get("GPU_TEST_MODEL", Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-instruct"))
MAX_TOKENS = 48

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason=f"{MODEL_DIR} missing: run `make model`"),
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers and explain why each one is prime."}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."}, {"role": "user", "content": "Why is the sky blue?"}],
    [
        {"role": "user", "content": "I am planning a trip to Japan in the spring. I like food, old temples, trains and quiet "
         "places away from crowds. I have ten days and a medium budget. Which cities should I visit, in what order, and "
         "how should I travel between them? Please keep the answer short."},
    ],
    [
        {"role": "user", "content": "Translate to French: The cat sleeps on the warm windowsill."},
        {"role": "assistant", "content": "Le chat dort sur le rebord de fenêtre chaud."},
        {"role": "user", "content": "Now to German."},
    ],
    [{"role": "user", "content": "Explain what a hash table is to a ten-year-old."}],
]


@pytest.fixture(scope="module", autouse=True)
def exact_fp32():
    """No TF32: fp32 matmuls must be real fp32 for token-exact comparisons."""
    if DEVICE.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    out = []
    for conv in CONVERSATIONS:
        encoded = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)
        out.append(list(encoded["input_ids"]))
    assert len({len(p) for p in out}) >= 6, "prompts should have different lengths"
    return out


def _strip_eos(tokens: list[int], eos: int) -> list[int]:
    """Engines differ in whether the final EOS is part of the output; compare without it."""
    tokens = list(tokens)
    return tokens[:-1] if tokens and tokens[-1] == eos else tokens


def hf_greedy(dtype: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """HF reference: one prompt at a time (no padding), greedy, stops at EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=getattr(torch, dtype)).to(DEVICE).eval()
    eos = model.config.eos_token_id if model.config.eos_token_id is not None else model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=DEVICE)
            gen = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, pad_token_id=eos
            )
            outs.append(_strip_eos(gen[0, len(prompt) :].tolist(), eos))
    del model
    if DEVICE.startswith("cuda"):
        torch.cuda.empty_cache()
    return outs


def native_greedy(dtype: str, prompts: list[list[int]], max_tokens: int, **engine_kwargs):
    from serve_app.engine import LLM, SamplingParams

    llm = LLM(str(MODEL_DIR), dtype=dtype, device=DEVICE, **{"kv_cache_memory_gib": 0.25, **engine_kwargs})
    (eos,) = llm.engine.input_processor.eos_token_ids
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return llm, [_strip_eos(o.token_ids, eos) for o in outs], outs


@pytest.fixture(scope="module")
def hf_fp32(prompts) -> list[list[int]]:
    return hf_greedy("float32", prompts, MAX_TOKENS)


def _assert_same(native: list[list[int]], reference: list[list[int]], tokenizer) -> None:
    for i, (a, b) in enumerate(zip(native, reference, strict=True)):
        if a != b:
            k = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            pytest.fail(
                f"prompt {i}: native and HF differ at output token {k} (lengths {len(a)} vs {len(b)})\n"
                f"native: {tokenizer.decode(a)!r}\nHF:     {tokenizer.decode(b)!r}"
            )


def test_fp32_token_exact_all_together(prompts, hf_fp32, tokenizer):
    _, native, _ = native_greedy("float32", prompts, MAX_TOKENS)
    _assert_same(native, hf_fp32, tokenizer)


def test_fp32_token_exact_chunked_prefill(prompts, hf_fp32, tokenizer):
    # a budget smaller than most prompts: prompts are split across steps and mixed with decodes
    _, native, _ = native_greedy("float32", prompts, MAX_TOKENS, max_num_batched_tokens=24)
    _assert_same(native, hf_fp32, tokenizer)


def test_fp32_token_exact_under_preemption(prompts, hf_fp32, tokenizer):
    # room for about two requests at a time: the scheduler must preempt (recompute) and resume
    need = max(len(p) for p in prompts) + MAX_TOKENS
    llm, native, outs = native_greedy("float32", prompts, MAX_TOKENS, num_blocks=2 * (need // 16 + 1) + 2, block_size=16)
    _assert_same(native, hf_fp32, tokenizer)
    preemptions = sum(getattr(o.metrics, "num_preemptions", 0) for o in outs if o.metrics is not None)
    assert preemptions > 0, "the KV cache was meant to be small enough to force preemption"
    block_manager = llm.engine.core.block_manager
    block_manager.check_integrity()
    assert block_manager.num_used_blocks == 0


def test_bf16_sanity(prompts, tokenizer):
    if (MODEL_DIR / "RANDOM_WEIGHTS").is_file():
        pytest.skip("random weights (loadtest/gpu_check.sh): no sensible text to check")
    reference = hf_greedy("bfloat16", prompts, 8)
    _, native, outs = native_greedy("bfloat16", prompts, MAX_TOKENS)
    first_equal = sum(a[:1] == b[:1] for a, b in zip(native, reference, strict=True))
    assert first_equal >= len(prompts) - 1, f"bf16 first tokens agree for only {first_equal}/{len(prompts)} prompts"
    assert "Paris" in outs[0].text, f"smoke prompt answered {outs[0].text!r}"
    for out in outs:
        assert out.text.strip(), "empty completion"
