"""AsyncLLMEngine: streams, bad input, aborts freeing blocks, and engine failure reaching callers."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.engine.async_engine import AsyncLLMEngine, EngineDeadError
from serve_app.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.heavy  # the real model behind the async engine, against HF: make test, not make test-fast

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = AsyncLLMEngine.from_kwargs(model_dir, dtype="float32", kv_cache_memory_gib=0.25)
    yield eng
    eng.shutdown()


async def collect(engine, request):
    text, tokens, last = "", [], None
    async for out in engine.generate(request):
        text += out.text
        tokens += out.token_ids
        last = out
    return text, tokens, last


def idle(engine) -> bool:
    load = engine.load()
    return load.num_free_blocks == load.num_total_blocks and load.num_running == load.num_waiting == 0


async def wait_idle(engine, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if idle(engine):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.load()}")


def test_streams_deltas_matching_offline(engine, model_dir, prompt_ids, hf_reference):
    async def main():
        results = await asyncio.gather(
            *[collect(engine, GenerateRequest(f"s{i}", prompt=p, sampling_params=SamplingParams(temperature=0.0, max_tokens=24))) for i, p in enumerate(prompt_ids)]
        )
        await wait_idle(engine)
        return results

    results = asyncio.run(main())
    assert [tokens for _, tokens, _ in results] == hf_reference
    for _text, tokens, last in results:
        assert last.finished and last.finish_reason is not None
        assert last.metrics.ttft_s > 0 and last.metrics.e2e_s >= last.metrics.ttft_s
        assert last.metrics.num_generation_tokens == len(tokens)


BAD_INPUTS = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1] * 9000}, "prompt"),  # longer than the context
    ({"prompt": [10**9]}, "prompt"),  # not a token id
    ({"messages": ()}, "messages"),
]
BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(stop=("",)), "stop"),
]


@pytest.mark.parametrize("fields,name", BAD_INPUTS)
def test_bad_request_is_rejected_and_engine_keeps_serving(engine, fields, name):
    async def main():
        good = asyncio.create_task(collect(engine, GenerateRequest(f"good-{name}-{id(fields)}", prompt="Hello", sampling_params=GREEDY)))
        with pytest.raises(ValueError, match=rf"^{name}:"):
            await collect(engine, GenerateRequest(f"bad-{name}-{id(fields)}", sampling_params=GREEDY, **fields))
        _, tokens, last = await good
        assert last.finished and len(tokens) == 12
        await wait_idle(engine)

    asyncio.run(main())


@pytest.mark.parametrize("kwargs,name", BAD_PARAMS)
def test_bad_sampling_params_name_the_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        SamplingParams(**kwargs)


def test_abort_mid_generation_frees_every_block(engine):
    async def main():
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        gen = engine.generate(GenerateRequest("to-abort", prompt="Tell me a long story.", sampling_params=long))
        other = asyncio.create_task(collect(engine, GenerateRequest("bystander", prompt="Hi", sampling_params=GREEDY)))
        n = 0
        async for _ in gen:
            n += 1
            if n == 5:
                break
        assert engine.load().num_free_blocks < engine.load().num_total_blocks
        await gen.aclose()  # what a disconnecting client does
        _, tokens, _ = await other
        assert len(tokens) == 12
        await wait_idle(engine)
        # explicit abort() returns once the blocks are free
        gen2 = engine.generate(GenerateRequest("to-abort-2", prompt="Another story.", sampling_params=long))
        await gen2.__anext__()
        await engine.abort("to-abort-2")
        assert idle(engine)
        await gen2.aclose()

    asyncio.run(main())
    engine.engine.core.block_manager.check_integrity()


def test_engine_failure_reaches_every_caller(model_dir):
    engine = AsyncLLMEngine.from_kwargs(model_dir, dtype="float32", kv_cache_memory_gib=0.1)
    runner = engine.engine.core.model_runner
    calls = {"n": 0}
    original = runner.execute_model

    def flaky(scheduler_output):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        return original(scheduler_output)

    runner.execute_model = flaky

    async def main():
        reqs = [collect(engine, GenerateRequest(f"f{i}", prompt="Hello there", sampling_params=SamplingParams(max_tokens=50, ignore_eos=True))) for i in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*reqs, return_exceptions=True), timeout=30)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError):
            await collect(engine, GenerateRequest("after", prompt="Hi", sampling_params=GREEDY))

    asyncio.run(main())
    with pytest.raises(EngineDeadError):
        engine.check_health()
    engine.shutdown()


def test_request_registered_just_after_engine_death_fails_at_once(model_dir):
    """The loop dies while a request is being tokenized (after `generate`'s first health check):
    the request must fail at once with EngineDeadError, not wait for a timeout."""
    engine = AsyncLLMEngine.from_kwargs(model_dir, dtype="float32", kv_cache_memory_gib=0.1)
    processor = engine.engine.input_processor
    original = processor.process

    def process_while_the_loop_dies(request):
        out = original(request)
        engine._inbox.put(("add", None, None))  # a malformed item: the loop raises on it and dies
        engine._thread.join(timeout=10)
        assert not engine._thread.is_alive()
        return out

    processor.process = process_while_the_loop_dies

    async def main():
        request = GenerateRequest("late", prompt="Hi", sampling_params=GREEDY)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(collect(engine, request), timeout=10)

    asyncio.run(main())
    engine.shutdown()


def test_streams_open_at_shutdown_end_with_an_error(model_dir):
    engine = AsyncLLMEngine.from_kwargs(model_dir, dtype="float32", kv_cache_memory_gib=0.1)

    async def main():
        request = GenerateRequest("long", prompt="Hi", sampling_params=SamplingParams(max_tokens=2000, ignore_eos=True))
        stream = engine.generate(request)
        await stream.__anext__()
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(stream.__anext__(), timeout=10)
            await asyncio.wait_for(stream.__anext__(), timeout=10)
        with pytest.raises(EngineDeadError):
            await collect(engine, GenerateRequest("after", prompt="Hi", sampling_params=GREEDY))

    asyncio.run(main())


def test_heartbeat_grows_only_while_a_step_hangs(model_dir):
    """`seconds_without_progress` is 0 while idle or stepping, and grows while a step hangs."""
    import threading

    from tests.polling import wait_for

    engine = AsyncLLMEngine.from_kwargs(model_dir, dtype="float32", kv_cache_memory_gib=0.1)
    runner = engine.engine.core.model_runner
    original = runner.execute_model
    hang, hanging = threading.Event(), threading.Event()

    def maybe_hang(scheduler_output):
        if hang.is_set():
            hanging.set()
            hang.wait_release.wait(60)
        return original(scheduler_output)

    hang.wait_release = threading.Event()
    runner.execute_model = maybe_hang
    assert engine.seconds_without_progress() == 0.0

    async def main():
        first = await collect(engine, GenerateRequest("ok", prompt="Hi", sampling_params=GREEDY))
        assert first[2].finished
        await wait_idle(engine)
        # idle (once the loop has come round to wait for requests): no progress expected
        await asyncio.to_thread(wait_for, lambda: engine.seconds_without_progress() == 0.0, 10, 0.05, "an idle loop")
        hang.set()
        task = asyncio.ensure_future(collect(engine, GenerateRequest("hung", prompt="Hi", sampling_params=GREEDY)))
        await asyncio.to_thread(hanging.wait, 30)
        await asyncio.to_thread(wait_for, lambda: engine.seconds_without_progress() > 0.5, 30, 0.05, "a stalled heartbeat")
        engine.check_health()  # alive: judging a stall is the replica's business (a bound in its config)
        hang.clear()
        hang.wait_release.set()
        _text, tokens, last = await asyncio.wait_for(task, 30)
        assert last.finished and len(tokens) == GREEDY.max_tokens
        await wait_idle(engine)
        await asyncio.to_thread(wait_for, lambda: engine.seconds_without_progress() == 0.0, 10, 0.05, "an idle loop")

    asyncio.run(main())
    engine.shutdown()
