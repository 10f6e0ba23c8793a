"""The ingress replica's process never imports torch: its modules and its tokenization
(serve_app/input_processor.py, loading the tokenizer class the engine resolved) run without it, and
give exactly the ids the engine's side gives (the class `AutoTokenizer` picks, the same chat ids).
The same check inside a running deployment's replicas: tests/serving/test_openai_api.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from serve_app.input_processor import InputProcessor, load_tokenizer, tokenizer_class_name
from serve_app.types import GenerateRequest
from tests.serving.conftest import MODEL_DIR, REPO

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Capital of France?"}]
VOCAB_SIZE = 49152

# what an ingress replica imports and runs: its deployment module, the app builder, and the tokenization
INGRESS = """
import json, sys
import serve_app.serving.app, serve_app.serving.ingress
from serve_app.input_processor import InputProcessor
from serve_app.types import GenerateRequest
model_dir, vocab_size, tokenizer_class, messages = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
processor = InputProcessor(model_dir, vocab_size, 2048, tokenizer_class)
chat = processor.process(GenerateRequest("c", messages=tuple(messages)))
text = processor.process(GenerateRequest("t", prompt="Hello there"))
print(json.dumps({"torch": "torch" in sys.modules, "tokenizer": type(processor.hf_tokenizer).__name__,
                  "chat": list(chat.prompt_token_ids), "text": list(text.prompt_token_ids)}))
"""


def test_the_ingress_tokenizes_without_importing_torch_and_as_the_engine_does():
    engine_side = InputProcessor(str(MODEL_DIR), VOCAB_SIZE, 2048)  # AutoTokenizer, as the engines load it
    tokenizer_class = engine_side.tokenizer_class
    assert tokenizer_class is not None and tokenizer_class.startswith("transformers.")
    out = subprocess.run([sys.executable, "-c", INGRESS, str(MODEL_DIR), str(VOCAB_SIZE), tokenizer_class,
                          json.dumps(MESSAGES)],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    ingress = json.loads(out.stdout.strip().splitlines()[-1])
    assert ingress["torch"] is False
    assert ingress["tokenizer"] == type(engine_side.hf_tokenizer).__name__
    assert ingress["chat"] == list(engine_side.process(GenerateRequest("c", messages=tuple(MESSAGES))).prompt_token_ids)
    assert ingress["text"] == engine_side.tokenize("Hello there")


def test_chat_ids_are_the_tokenizers_own():
    """`apply_chat_template` is the model's chat template, generation prompt added, nothing else."""
    processor = InputProcessor(str(MODEL_DIR), VOCAB_SIZE, 2048)
    expected = processor.hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"]
    assert processor.apply_chat_template(MESSAGES) == list(expected)
    tokens = processor.hf_tokenizer.convert_ids_to_tokens(expected)
    assert tokens[-4:] == ["<|im_start|>", "ass", "istant", "Ċ"]  # SmolLM2's ChatML generation prompt


def test_only_transformers_tokenizer_classes_are_loaded_by_name():
    assert tokenizer_class_name(None) is None
    assert load_tokenizer(str(REPO / "configs")) is None  # no tokenizer.json: no tokenizer
    with pytest.raises(ValueError, match="^tokenizer_class: 'os.system' is not a transformers tokenizer class"):
        load_tokenizer(str(MODEL_DIR), "os.system")
