"""Grouped admission (`waiting_served_ratio`) with the real model: prompts that arrive while others decode
join in groups, and every request's tokens are those it gets from an engine that admits at once."""

from __future__ import annotations

from serve_app.engine import LLM
from serve_app.types import GenerateRequest, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_late_prompts_join_in_a_group_and_answer_as_they_do_alone(model_dir, prompt_ids):
    llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory_gib=0.05, waiting_served_ratio=0.5, max_waiting_steps=50)
    engine, tokens, admitted = llm.engine, {}, {}

    def step(index: int) -> None:
        for out in engine.step():
            tokens[out.request_id] = tokens.get(out.request_id, ()) + out.token_ids
        for rid in engine.core.scheduler.requests:
            admitted.setdefault(rid, None)
        for request in engine.core.scheduler.running:
            admitted[request.request_id] = admitted[request.request_id] if admitted[request.request_id] is not None else index

    first, late = prompt_ids[:4], prompt_ids[4:6]
    for i, prompt in enumerate(first):
        engine.add_request(GenerateRequest(f"r{i}", prompt=prompt, sampling_params=PARAMS))
    step(0)
    step(1)  # (prompts sharing the chat template's first block with r0 read it from the cache a step later)
    assert len(engine.core.scheduler.running) == 4
    engine.add_request(GenerateRequest("late0", prompt=late[0], sampling_params=PARAMS))
    step(2)
    step(3)  # one waits beside four running: held
    engine.add_request(GenerateRequest("late1", prompt=late[1], sampling_params=PARAMS))
    index = 4
    while engine.has_unfinished_requests():
        step(index)
        index += 1
    assert admitted["late0"] == admitted["late1"] == 4  # two wait beside four: 2 >= 0.5 x 4, together

    reference = LLM(model_dir, dtype="bfloat16", kv_cache_memory_gib=0.05)
    expected = [out.token_ids for out in reference.generate([*first, *late], PARAMS)]
    assert [tokens[rid] for rid in ("r0", "r1", "r2", "r3", "late0", "late1")] == expected
