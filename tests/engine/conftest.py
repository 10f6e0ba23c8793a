"""Engine fixtures: real chat prompts, HF transformers reference outputs, a tiny random model."""

from __future__ import annotations

import pytest
import torch

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Hi!",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 10.",
    "Translate 'good morning' into Spanish and German.",
    "You are given a long task description. Read it carefully: a farmer has seventeen sheep, all but nine "
    "run away, and then he buys four more sheep at the market on Tuesday. How many sheep does he have now? "
    "Answer with a number and a short explanation of the reasoning.",
    "Summarize the plot of Romeo and Juliet for a ten year old child who has never heard of Shakespeare, "
    "in a friendly tone, and mention how the story ends.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> list[list[int]]:
    """Chat-templated prompts of different lengths, as token ids."""
    ids = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True)["input_ids"])
        for p in CHAT_PROMPTS
    ]
    assert len({len(i) for i in ids}) >= 6  # genuinely different lengths
    return ids


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="session")
def hf_reference(model_dir, prompt_ids) -> list[list[int]]:
    """HF transformers greedy fp32 continuation of each prompt (EOS included when generated)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = [hf_greedy(model, p, MAX_TOKENS, model.config.eos_token_id) for p in prompt_ids]
    del model
    return refs
