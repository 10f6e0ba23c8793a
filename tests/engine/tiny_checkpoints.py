"""Tiny random-weight checkpoints with a tokenizer, saved the way HF saves real ones.

Only SmolLM2 ships as a package here, so other architectures are tested from configs with random
weights. Llama-3-style models get a word-level tokenizer (vocabulary: special tokens, chat roles,
words `w0`..`w249`) that prepends `<|begin_of_text|>` to text as Llama-3's does; Qwen2-style models
reuse SmolLM2's byte-level BPE tokenizer and ChatML template (transformers loads a qwen2 checkpoint's
tokenizer as its own BPE class, which a word-level vocabulary does not survive), which adds nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

SPECIALS = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["user", "assistant", "system"] + [f"w{i}" for i in range(250)]
VOCAB = {t: i for i, t in enumerate(SPECIALS + WORDS)}
BOS, END_OF_TEXT, EOT, IM_END = VOCAB["<|begin_of_text|>"], VOCAB["<|end_of_text|>"], VOCAB["<|eot_id|>"], VOCAB["<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")
COMMON = dict(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def save_tokenizer(path: Path, add_bos: bool) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", BOS)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token=SPECIALS[EOT],
                                 unk_token="<unk>", pad_token="<|end_of_text|>", additional_special_tokens=SPECIALS[3:])
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(path)


def llama3_config(**overrides):
    """Llama-3-style: untied head, llama3 RoPE scaling, several EOS ids."""
    from transformers import LlamaConfig

    kwargs = dict(COMMON, tie_word_embeddings=False, rope_theta=500000.0, bos_token_id=BOS, eos_token_id=[END_OF_TEXT, EOT],
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 32})
    return LlamaConfig(**{**kwargs, **overrides})


SMOLLM2_VOCAB = 49152
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def qwen2_config(**overrides):
    """Qwen2-style: q/k/v bias, tied embeddings, SmolLM2's vocabulary."""
    from transformers import Qwen2Config

    return Qwen2Config(**{**COMMON, "vocab_size": SMOLLM2_VOCAB, "tie_word_embeddings": True, "rope_theta": 1000000.0,
                          "eos_token_id": 2, **overrides})


def copy_tokenizer(src: str | Path, dest: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(src) / name, dest / name)


def build(config, seed: int = 0):
    """A random-weight HF model for `config`. Weights get a larger spread than HF's init (at std
    0.02 a tied model just repeats its last token and logits nearly tie), biases are random (a
    dropped bias shows)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.5)
        elif p.dim() == 2:
            torch.nn.init.normal_(p, std=0.3 if "embed" in name else 0.2)
    return model


def save(model, path: Path, add_bos: bool | None = None, generation: dict | None = None) -> str:
    """Save weights, config, (with `add_bos` not None) the word-level tokenizer and (optionally)
    extra generation_config.json fields."""
    from transformers import GenerationConfig

    model.save_pretrained(path)
    if generation is not None:
        gen = GenerationConfig.from_model_config(model.config)
        for k, v in generation.items():
            setattr(gen, k, v)
        gen.save_pretrained(path)
    if add_bos is not None:
        save_tokenizer(path, add_bos)
    return str(path)
