"""A failure belongs to its request: a fault injected into one request's admission, sampling or
detokenizing (before its first token or mid-stream) ends that request alone with
`RequestFailedError`, frees its KV blocks, and leaves a neighbour stream in the same steps
token-identical to a run without the fault; the engine stays healthy."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.engine.async_engine import AsyncLLMEngine
from serve_app.engine.config import EngineConfig
from serve_app.faults import Stage
from serve_app.types import GenerateRequest, RequestFailedError, SamplingParams
from tests.serving.faults import RequestFaults, fault_user

pytestmark = pytest.mark.heavy  # the real model, a fault at every stage: make test, not make test-fast

NEIGHBOUR_TOKENS = 24
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEIGHBOUR_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = AsyncLLMEngine(EngineConfig.from_kwargs(model_dir, dtype="float32", kv_cache_memory_gib=0.25), fault_hook=RequestFaults())
    yield eng
    eng.shutdown()


async def run(engine, request) -> tuple[list[int], BaseException | None]:
    tokens: list[int] = []
    try:
        async for out in engine.generate(request):
            tokens += out.token_ids
    except RequestFailedError as exc:
        return tokens, exc
    return tokens, None


async def wait_idle(engine, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        load = engine.load()
        if load.num_free_blocks == load.num_total_blocks and load.num_running == load.num_waiting == 0:
            engine.engine.core.block_manager.check_integrity()
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.load()}")


@pytest.fixture(scope="module")
def reference(engine) -> list[int]:
    tokens, error = asyncio.run(run(engine, GenerateRequest("ref", prompt="Once upon a time", sampling_params=PARAMS)))
    assert error is None and len(tokens) == NEIGHBOUR_TOKENS
    return tokens


@pytest.mark.parametrize("stage, after", [(Stage.PREPARE, 0), (Stage.SAMPLE, 0), (Stage.SAMPLE, 5),
                                          (Stage.DETOKENIZE, 0), (Stage.DETOKENIZE, 5)])
def test_a_fault_ends_its_request_alone(engine, reference, stage, after):
    async def main():
        neighbour = asyncio.create_task(run(engine, GenerateRequest(f"n-{stage}-{after}", prompt="Once upon a time",
                                                                     sampling_params=PARAMS)))
        victim = await run(engine, GenerateRequest(f"v-{stage}-{after}", prompt="Tell me a story about a dragon",
                                                   sampling_params=PARAMS, user=fault_user(stage, after)))
        result = await neighbour
        await wait_idle(engine)
        return victim, result

    (victim_tokens, victim_error), (tokens, error) = asyncio.run(main())
    assert isinstance(victim_error, RequestFailedError) and victim_error.stage == stage, victim_error
    if after:  # mid-stream: the victim had streamed tokens before it failed
        assert 0 < len(victim_tokens) < NEIGHBOUR_TOKENS
    else:
        assert victim_tokens == []
    assert error is None and tokens == reference  # the neighbour is untouched
    engine.check_health()


def test_engine_serves_on_after_faults(engine, reference):
    tokens, error = asyncio.run(run(engine, GenerateRequest("after", prompt="Once upon a time", sampling_params=PARAMS)))
    assert error is None and tokens == reference
