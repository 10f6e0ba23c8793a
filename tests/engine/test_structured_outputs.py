"""Structured outputs in the native engine: every constrained output parses and validates, and a
constraint changes nothing but its own request (batch invariance, speculation, prefix cache, preemption).

SmolLM2 (bf16, the invariant default) and a random-weight Qwen2 (its vocabulary is SmolLM2's): a
random model writes noise, so only the grammar makes its outputs valid. Schemas bound every string
and array, so no output can run out of tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest

from serve_app.engine import LLM, SamplingParams
from serve_app.types import FinishReason, StructuredOutput
from tests.engine import tiny_checkpoints as tc
from tests.recording_logger import RecordingLogger

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "address"]}
SCORES = {"type": "object", "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 99},
                                                      "minItems": 2, "maxItems": 4}},
          "required": ["scores"]}
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
         "required": ["color", "ok"]}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
ANIMALS = ("cat", "dog", "giraffe", "sea otter")

CASES = [  # (constraint, prompt, check)
    (StructuredOutput(json_schema=json.dumps(PERSON)), "Describe a person as JSON.", PERSON),
    (StructuredOutput(json_schema=json.dumps(SCORES)), "Give some test scores as JSON.", SCORES),
    (StructuredOutput(json_schema=json.dumps(COLOR)), "Pick a color, as JSON.", COLOR),
    (StructuredOutput(regex=PHONE), "Write a US phone number.", PHONE),
    (StructuredOutput(choice=ANIMALS), "Name an animal.", ANIMALS),
]
MAX_TOKENS = 160


def check(out, expected) -> None:
    assert out.finish_reason == FinishReason.STOP, (out.text, out.finish_reason)
    if isinstance(expected, dict):
        jsonschema.validate(json.loads(out.text), expected)
    elif isinstance(expected, tuple):
        assert out.text in expected
    else:
        assert re.fullmatch(expected, out.text), out.text


def chat(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def params(structured: StructuredOutput | None, seed: int | None = None, **kwargs) -> SamplingParams:
    sampling = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "top_p": 0.95, "seed": seed}
    return SamplingParams(max_tokens=MAX_TOKENS, structured=structured, **sampling, **kwargs)


@pytest.fixture(scope="module")
def smol(model_dir):
    llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory_gib=0.05, speculative={"method": "ngram", "k": 3})
    yield llm
    llm.engine.core.block_manager.check_integrity()


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("qwen2")
    tc.save(tc.build(tc.qwen2_config()), path)
    tc.copy_tokenizer(model_dir, path)
    return LLM(str(path), dtype="float32", kv_cache_memory_gib=0.05)


def run_all(llm: LLM, tokenizer, seeds: tuple[int | None, ...]) -> None:
    prompts, sps, expected = [], [], []
    for seed in seeds:
        for structured, text, exp in CASES:
            prompts.append(chat(tokenizer, text))
            sps.append(params(structured, seed))
            expected.append(exp)
    outs = llm.generate(prompts, sps)
    for out, exp in zip(outs, expected, strict=True):
        check(out, exp)
    bm = llm.engine.core.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0


def test_every_output_validates_on_smollm2(smol, tokenizer):
    run_all(smol, tokenizer, (None, 7))


def test_every_output_validates_on_a_random_qwen2(qwen2, tokenizer):
    run_all(qwen2, tokenizer, (None, 3, 11))


def test_json_object_is_an_object(smol, tokenizer):
    """Any JSON object: unbounded, so only a prompt that asks for a small one can be held to a budget."""
    out = smol.generate([chat(tokenizer, 'Reply with exactly this JSON: {"answer": "yes", "score": 3}')],
                        params(StructuredOutput(json_object=True)))[0]
    check(out, {"type": "object"})


def test_compile_failure_aborts_only_that_request(smol, tokenizer):
    """A spec that parses but fails to compile against the vocabulary (here: forced by a bad compiled
    future) ends its request with an error; the engine and its neighbour go on."""
    from concurrent.futures import Future

    from serve_app.engine.grammar_state import GrammarState
    from serve_app.engine.request import Request
    from serve_app.types import GenerateRequest

    engine = smol.engine
    bad = GenerateRequest("bad", prompt=chat(tokenizer, "Hi"), sampling_params=params(StructuredOutput(regex="a+")))
    request = Request.from_processed(engine.input_processor.process(bad))
    failed: Future = Future()
    failed.set_exception(RuntimeError("[18:00:00] /x.cc:1: no way"))
    request.grammar = GrammarState(failed, request.eos_token_ids)
    engine.add_processed(bad, request)
    engine.add_request(GenerateRequest("good", prompt=chat(tokenizer, "Name an animal."),
                                      sampling_params=params(StructuredOutput(choice=ANIMALS))))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad"].finish_reason == FinishReason.ABORT
    assert "no way" in str(finished["bad"].error) and "[18:00:00]" not in str(finished["bad"].error)
    assert finished["good"].finish_reason == FinishReason.STOP


def constrained(tokenizer) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded constrained requests (two with consecutive seeds: what the API sends for n=2)."""
    person, scores, phone = CASES[0], CASES[1], CASES[3]
    return [(chat(tokenizer, person[1]), params(person[0])),
            (chat(tokenizer, scores[1]), params(scores[0], seed=7)),
            (chat(tokenizer, scores[1]), params(scores[0], seed=8)),
            (chat(tokenizer, phone[1]), params(phone[0], seed=2))]


def neighbours(tokenizer) -> list[tuple[list[int], SamplingParams]]:
    """Unconstrained requests: greedy, seeded, and one with a logit_bias."""
    return [(chat(tokenizer, "Write a haiku about the sea."), SamplingParams(temperature=0.0, max_tokens=40)),
            (chat(tokenizer, "List three prime numbers."), SamplingParams(temperature=0.9, seed=1, max_tokens=40)),
            (chat(tokenizer, "Say hello."), SamplingParams(temperature=0.0, max_tokens=8, logit_bias=((28, 5.0), (30, -3.0))))]


def tokens(llm: LLM, requests, speculative: bool = True) -> list[list[int]]:
    outs = llm.generate([p for p, _ in requests], [sp if speculative else replace(sp, speculative=False) for _, sp in requests])
    for out, (_, sp) in zip(outs, requests, strict=True):
        if sp.structured is not None:
            assert out.finish_reason == FinishReason.STOP
    return [list(o.token_ids) for o in outs]


@pytest.mark.heavy  # the real model over a batch, twice: about 8 s
def test_a_constraint_changes_nothing_but_its_own_request(model_dir, tokenizer):
    """Each constrained request alone without speculation == beside unconstrained neighbours with
    n-gram speculation == again from the prefix cache; the neighbours' tokens are those they get
    without constrained company."""
    steps = RecordingLogger()
    llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory_gib=0.05, speculative={"method": "ngram", "k": 3}, stat_loggers=[steps])
    cons, neigh = constrained(tokenizer), neighbours(tokenizer)
    alone = [tokens(llm, [r], speculative=False)[0] for r in cons]
    # three distinct specs compiled once each (the two seeded requests share theirs); masks timed per step
    assert sum(len(s.grammar_compile_s) for s in steps.steps) == 3
    assert all(s.grammar_mask_s is not None and s.grammar_mask_s > 0 for s in steps.steps if s.num_decode_tokens)
    llm.reset_prefix_cache()
    neigh_alone = tokens(llm, neigh)
    llm.reset_prefix_cache()
    steps.steps.clear()
    mixed = tokens(llm, cons + neigh)
    assert mixed == alone + neigh_alone
    assert not any(s.grammar_compile_s for s in steps.steps)  # cached
    assert sum(s.spec_num_accepted for s in steps.steps) > 0  # speculation verified (and kept) tokens
    steps.steps.clear()
    again = tokens(llm, neigh + cons)  # the prompts' blocks are cached now
    assert again == neigh_alone + alone
    assert sum(s.prefix_cache_hits for s in steps.steps) > 0
    bm = llm.engine.core.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0


@pytest.mark.heavy  # the real model through preemption: about 5 s
def test_preempted_constrained_requests_resume_where_they_were(model_dir, tokenizer, smol):
    cons = constrained(tokenizer)
    reference = [tokens(smol, [r], speculative=False)[0] for r in cons]
    # 7 blocks of 16 tokens hold one request's 64 + prompt tokens, not all four: the newest is preempted
    small = LLM(model_dir, dtype="bfloat16", num_blocks=7, block_size=16, speculative={"method": "ngram", "k": 3})
    outs = small.generate([p for p, _ in cons], [replace(sp, max_tokens=64) for _, sp in cons])
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [list(o.token_ids) for o in outs] == reference
    small.engine.core.block_manager.check_integrity()


PRODUCT = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "price_usd": {"type": "integer", "minimum": 1, "maximum": 100000},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "price_usd", "tags"]}
ITEMS = ["a hammer", "a teapot", "a garden hose", "a toy robot", "a cookbook", "headphones", "a drill", "a frying pan",
         "a rake", "a puzzle", "a novel", "a phone charger", "a screwdriver set", "a kettle"]


@pytest.mark.heavy  # 14 requests alone, then 16 at once: about 30 s
def test_a_constrained_request_is_the_same_alone_and_in_a_batch_of_16(model_dir, tokenizer):
    """Greedy constrained requests (their rows checked against the grammar) and seeded ones (masked
    whole), each alone without speculation and all 16 at once with n-gram speculation beside two
    unconstrained requests: the same tokens, every output valid."""
    llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory_gib=0.25, speculative={"method": "ngram", "k": 3})
    spec = StructuredOutput(json_schema=json.dumps(PRODUCT))
    cons = [(chat(tokenizer, f"Describe {item} for an online shop, as JSON."), params(spec, seed=i if i >= 12 else None))
            for i, item in enumerate(ITEMS)]
    neigh = neighbours(tokenizer)[:2]
    alone = [tokens(llm, [r], speculative=False)[0] for r in cons]
    batch = tokens(llm, cons + neigh)
    assert batch[: len(cons)] == alone
    for ids in alone:
        jsonschema.validate(json.loads(tokenizer.decode(ids, skip_special_tokens=True)), PRODUCT)
    llm.engine.core.block_manager.check_integrity()
