"""Validates and tokenizes incoming requests into `ProcessedRequest`s (torch-free).

Both sides run it: the engines (the native engine turns a `ProcessedRequest` into its own `Request`;
the vLLM backend hands the ids to vLLM) and the ingress replica, which tokenizes once so the router
can hash the ids. It never imports torch (tests/serving/test_ingress_imports.py), so neither does the
ingress: `load_tokenizer` names the tokenizer's class, and the ingress loads the class the engine
resolved (`ModelInfo.tokenizer_class`) rather than resolving it itself through `AutoTokenizer`,
whose configuration classes import torch.

Every rejection is a `ValueError` whose message starts with the offending field (`prompt`,
`messages`, `max_tokens`, ...), raised before the request touches the scheduler.

Tokenization follows the model's own tokenizer settings: a text prompt gets the special tokens its
tokenizer adds (Llama and Mistral prepend a BOS, SmolLM2 and Qwen2 add nothing); a chat is rendered
by the chat template, which writes its special tokens itself.

Context length (the same rule as OpenAI's API): a request whose prompt plus `max_tokens` does not
fit the context is rejected (`max_tokens: ...`, naming both numbers), never cut short silently;
`max_tokens` None means the room left in the context. Text that cannot fit is rejected before it is
tokenized: no token is longer than the vocabulary's longest entry (`max_token_chars`), so a text of
more than `max_model_len * max_token_chars` characters has more tokens than the context holds.

Model-dependent bounds of `SamplingParams` live here, so both backends get them: `stop_token_ids`
and `logit_bias` token ids below the vocabulary size; a structured-output spec that parses
(the engines' `check_structured`, about a millisecond; compiling it is the engine's); `top_k` at or above it keeps every token and becomes 0 (disabled).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_app.generation_config import GenerationDefaults
from serve_app.types import GenerateRequest, SamplingParams, StructuredOutput


def load_tokenizer(model_dir: str, tokenizer_class: str | None = None) -> Any | None:
    """The model's Hugging Face tokenizer, or None without `tokenizer.json`.

    `tokenizer_class` ("module.ClassName", what `tokenizer_class_name` returned on a process that
    resolved it): that class is loaded directly, without importing torch. None: `AutoTokenizer`
    resolves it (its configuration classes import torch: only where torch is loaded anyway)."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return None
    if tokenizer_class is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    module, _, name = tokenizer_class.rpartition(".")
    if not module.startswith("transformers."):
        raise ValueError(f"tokenizer_class: {tokenizer_class!r} is not a transformers tokenizer class")
    return getattr(importlib.import_module(module), name).from_pretrained(model_dir)


def tokenizer_class_name(tokenizer: Any | None) -> str | None:
    """"module.ClassName" of `tokenizer` (what `load_tokenizer` takes), or None."""
    return None if tokenizer is None else f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}"


def template_renders_tools(chat_template: Any) -> bool:
    """Whether a chat template reads the `tools` variable (False without a template)."""
    if not isinstance(chat_template, str) or not chat_template:
        return False
    from jinja2 import Environment, meta
    from jinja2.exceptions import TemplateError

    try:  # HF renders templates with the loop-controls extension
        ast = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except TemplateError:
        return False
    return "tools" in meta.find_undeclared_variables(ast)


@dataclass(frozen=True)
class ProcessedRequest:
    """A request validated against the model: its prompt as token ids and its sampling parameters
    with the model-dependent bounds applied."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float
    cache_salt: bytes | None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class InputProcessor:
    def __init__(self, model_dir: str, vocab_size: int, max_model_len: int, tokenizer_class: str | None = None,
                 check_structured: Callable[[StructuredOutput], None] | None = None) -> None:
        """`tokenizer_class`: see `load_tokenizer` (None: resolved by `AutoTokenizer`).
        `check_structured`: raises ValueError for a structured-output spec the grammar library cannot
        parse (`engine.grammar.check_structured`; it imports torch, so the engines pass it and the
        ingress does not: there an unparsable spec is the engine's 400)."""
        self.check_structured = check_structured
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.generation_defaults = GenerationDefaults.from_model_dir(model_dir)
        self.hf_tokenizer = load_tokenizer(model_dir, tokenizer_class)
        # characters in the longest vocabulary entry (byte-level BPE writes one character per byte,
        # so a token's text is never longer than its entry); None without a tokenizer
        self.max_token_chars = None
        if self.hf_tokenizer is not None:
            self.max_token_chars = max(1, max(map(len, self.hf_tokenizer.get_vocab()), default=1))

    @property
    def max_prompt_chars(self) -> int | None:
        """Text longer than this cannot fit the context whatever it is (None: no tokenizer)."""
        return None if self.max_token_chars is None else self.max_model_len * self.max_token_chars

    def check_text_fits(self, param: str, num_chars: int) -> None:
        """Reject `num_chars` of text that cannot fit the context, before spending time tokenizing it."""
        limit = self.max_prompt_chars
        if limit is not None and num_chars > limit:
            raise ValueError(f"{param}: {num_chars} characters cannot fit the context length of {self.max_model_len} "
                             f"tokens (at most {limit} characters: {self.max_token_chars} per token)")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.generation_defaults.eos_token_ids

    @property
    def chat_template_tools(self) -> bool:
        """The chat template renders `tools` itself (else serving/tool_prompt.py writes them)."""
        return template_renders_tools(getattr(self.hf_tokenizer, "chat_template", None))

    @property
    def tokenizer_class(self) -> str | None:
        """The tokenizer's class as `load_tokenizer` takes it (another process loads the same one)."""
        return tokenizer_class_name(self.hf_tokenizer)

    @property
    def tokenizer(self):
        """The fast (Rust) tokenizer used for incremental detokenization, or None without one."""
        return None if self.hf_tokenizer is None else self.hf_tokenizer.backend_tokenizer

    def apply_chat_template(self, messages: list[dict[str, Any]] | tuple[dict[str, Any], ...],
                            tools: tuple[dict[str, Any], ...] | None = None) -> list[int]:
        """The chat's prompt ids (generation prompt added); `tools`: OpenAI tool definitions, handed
        to a template that renders them."""
        if self.hf_tokenizer is None or not getattr(self.hf_tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template")
        if not messages:
            raise ValueError("messages: must not be empty")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("messages: each message needs a string 'role' and a string 'content'")
        self.check_text_fits("messages", sum(len(m["content"]) + len(m.get("name") or "") for m in messages)
                             + (len(json.dumps(tools)) if tools else 0))
        rendered = self.hf_tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                         add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(rendered["input_ids"])

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.hf_tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; send token ids")
            self.check_text_fits("prompt", len(prompt))
            return self.hf_tokenizer.encode(prompt)  # with the special tokens this tokenizer adds
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"prompt: token ids must be integers in [0, {self.vocab_size})")
        return list(prompt)

    def process(self, request: GenerateRequest) -> ProcessedRequest:
        """`request` validated and tokenized; ValueError naming the field otherwise."""
        if request.prompt_token_ids is not None:  # tokenized by the ingress
            token_ids = self.tokenize(list(request.prompt_token_ids))
        elif request.messages is not None:
            token_ids = self.apply_chat_template(request.messages, request.tools)
        else:
            token_ids = self.tokenize(request.prompt)
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens leave no room to generate within the context length "
                f"of {self.max_model_len} tokens"
            )
        params = request.sampling_params
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=room)  # min_tokens > room: ValueError naming it
        if params.max_tokens > room:
            raise ValueError(
                f"max_tokens: the prompt's {len(token_ids)} tokens plus max_tokens={params.max_tokens} exceed the "
                f"context length of {self.max_model_len} tokens (at most {room} tokens can be generated)"
            )
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids: token ids must be integers in [0, {self.vocab_size})")
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if params.structured is not None and self.check_structured is not None:
            self.check_structured(params.structured)  # a bad schema / regex / grammar: the library's message
        if params.top_k >= self.vocab_size:  # keeps every token: the same as off, and no huge integer reaches a tensor
            params = dataclasses.replace(params, top_k=0)
        return ProcessedRequest(
            request_id=request.request_id,
            prompt_token_ids=tuple(token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=request.arrival_time,
            cache_salt=request.cache_salt.encode() if request.cache_salt else None,
        )
