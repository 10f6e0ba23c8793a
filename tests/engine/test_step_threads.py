"""`decode_threads`: a step that reads no prompt token runs on that many torch threads, any other step on
the caller's count, and the caller's count is back after every step. (That the logits do not depend on the
thread count is checked with every other step shape in test_batch_invariance.py.)"""

from __future__ import annotations

import contextlib

import pytest
import torch

from serve_app.engine import LLM
from serve_app.engine.config import ModelConfig
from serve_app.engine.step_threads import StepThreads
from serve_app.types import SamplingParams


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def threads_per_step(llm: LLM, prompts: list[list[int]]) -> list[tuple[bool, int]]:
    """(the step read prompt tokens, torch's thread count during its forward) for every step of `prompts`."""
    runner, seen = llm.engine.core.model_runner, []
    forward = runner._forward

    def recorded(scheduled):
        seen.append((any(s.reads_prompt for s in scheduled), torch.get_num_threads()))
        return forward(scheduled)

    runner._forward = recorded
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    finally:
        runner._forward = forward
    return seen


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, dtype="bfloat16", kv_cache_memory_gib=0.05, max_num_batched_tokens=16, decode_threads=1)


@pytest.mark.parametrize(("decode_threads", "prompt_steps", "decode_steps"), [(1, 3, 1), (0, 3, 3), (3, 3, 3), (2, 3, 2)])
def test_decode_steps_run_on_decode_threads(llm, decode_threads, prompt_steps, decode_steps):
    runner = llm.engine.core.model_runner
    configured = runner.threads
    assert configured.decode == 1  # the option reaches the runner
    runner.threads = StepThreads(decode_threads)
    llm.reset_prefix_cache()  # every prompt token is read again
    try:
        with torch_threads(3):
            # 40 prompt tokens in chunks of 16: three steps read prompt tokens (the last with the first decodes), four only decode
            seen = threads_per_step(llm, [list(range(100, 120)), list(range(200, 220))])
            assert torch.get_num_threads() == 3
    finally:
        runner.threads = configured
    assert [n for reads, n in seen if reads] == [prompt_steps] * 3
    assert [n for reads, n in seen if not reads] == [decode_steps] * 4


def test_decode_threads_is_a_cpu_option():
    with pytest.raises(ValueError, match="decode_threads"):
        ModelConfig("m", device="cuda", decode_threads=1)
    for bad in (-1, 1.5, "1", True):
        with pytest.raises(ValueError, match="decode_threads"):
            ModelConfig("m", decode_threads=bad)
