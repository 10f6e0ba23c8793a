"""Structured outputs: compiling a `StructuredOutput` into an xgrammar grammar, and checking one at the edge.

xgrammar was chosen by measurement (reports/grammar_libs.md, docs/structured-outputs.md). A spec
compiles once per engine: `GrammarCompiler.submit` returns a future from a bounded LRU cache keyed
by the spec's (kind, spec), compiled by one worker thread off the engine loop (xgrammar's C++ work
releases the GIL), so a slow compile never stalls other requests' steps.

JSON is generated without free whitespace (`any_whitespace=False`: one line, separators ", " and
": "), so whitespace cannot eat a request's token budget; schemas are compiled in xgrammar's strict
mode (no properties beyond those listed).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from serve_app.types import StructuredOutput

JSON_OBJECT_SCHEMA = '{"type": "object"}'
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:[0-9]+: ")  # "[18:12:43] /project/cpp/x.cc:83: "


def library_message(exc: BaseException) -> str:
    """xgrammar's error message without its timestamp and source location."""
    return _XGR_PREFIX.sub("", str(exc).strip()).strip()


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar matching exactly one of `choices` (string literals in JSON's escaping)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_structured(spec: StructuredOutput) -> None:
    """Parse `spec` without compiling it against a vocabulary (about a millisecond): raises
    `ValueError("structured: ...")` with the library's message when it is not a valid JSON schema,
    regex or grammar. What passes here compiles (a compile failure later aborts the request alone)."""
    import xgrammar as xgr

    kind = spec.kind
    try:
        if kind == "json_schema":
            schema = json.loads(spec.json_schema)
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema must be a JSON object or a boolean")
            xgr.Grammar.from_json_schema(spec.json_schema, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec.regex)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec.grammar)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(spec.choice))
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"structured: invalid {kind}: {library_message(exc)}") from None


class GrammarCompiler:
    """Compiled grammars for one engine's vocabulary: `submit` is non-blocking and thread-safe.

    `tokenizer_dir`/`vocab_size`: the model's tokenizer and its logits' width (the bitmask covers
    that many tokens). `on_compiled(seconds)` is called from the worker after each compile (metrics).
    The tokenizer's vocabulary is read on the first compile, not at engine start.
    """

    def __init__(self, tokenizer_dir: str, vocab_size: int, cache_size: int = 128,
                 on_compiled: Callable[[float], None] | None = None) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.on_compiled = on_compiled
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._compiler = None  # xgrammar's, built by the worker on first use

    def submit(self, spec: StructuredOutput) -> Future:
        """A future of the compiled grammar (shared by every request with the same spec)."""
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._forget_failure(key, f))
        return future

    def _forget_failure(self, key: tuple, future: Future) -> None:
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _compile(self, spec: StructuredOutput) -> Any:
        start = time.perf_counter()
        compiler = self._xgr_compiler()
        kind = spec.kind
        if kind == "json_schema":
            compiled = compiler.compile_json_schema(spec.json_schema, any_whitespace=False)
        elif kind == "json_object":
            compiled = compiler.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False)
        elif kind == "regex":
            compiled = compiler.compile_regex(spec.regex)
        elif kind == "choice":
            compiled = compiler.compile_grammar(choice_grammar(spec.choice))
        else:
            compiled = compiler.compile_grammar(spec.grammar)
        if self.on_compiled is not None:
            self.on_compiled(time.perf_counter() - start)
        return compiled

    def _xgr_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            # one thread: the engine's own threads run the model; xgrammar's cache is ours (the LRU)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
