"""ProcessLLMEngine, the engine stepping in a process of its own, against the engine thread
(AsyncLLMEngine) on the same requests: the same tokens (and HF's), the same stats replayed on the
parent's loggers, the same prefix-cache contents mirrored, a step-cost fit from the same steps;
bad input, aborts that free blocks, a request's own fault, a slow step in the heartbeat; and every
way the child can end (killed, a parent-side logger failing, shutdown, a failed start) reaching
every caller without a hang or a process left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from serve_app.engine.async_engine import AsyncLLMEngine
from serve_app.engine.config import EngineConfig
from serve_app.engine.process_engine import ProcessLLMEngine
from serve_app.engine.request_streams import EngineDeadError
from serve_app.engine.step_cost import fit_step_cost
from serve_app.faults import Stage
from serve_app.types import GenerateRequest, RequestFailedError, SamplingParams
from tests.engine.test_async_engine import collect, idle, wait_idle
from tests.polling import wait_for
from tests.recording_logger import RecordingLogger
from tests.serving.faults import RequestFaults, fault_user

pytestmark = pytest.mark.heavy  # the real model in a child process, and beside it in a thread: make test

ENGINE = dict(dtype="float32", kv_cache_memory_gib=0.25)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
SLOW_STEP_S = 2.0


class SlowSampling(RequestFaults):
    """`RequestFaults`, and a request whose id starts with "slow-" holds its step `SLOW_STEP_S` at its
    first sampling (in the child: the hook travels there with the config)."""

    def __init__(self) -> None:
        super().__init__()
        self._slowed: set[str] = set()

    def check(self, stage, request_id: str) -> None:
        if stage == Stage.SAMPLE and request_id.startswith("slow-") and request_id not in self._slowed:
            self._slowed.add(request_id)
            time.sleep(SLOW_STEP_S)
        super().check(stage, request_id)


@pytest.fixture(scope="module")
def engines(model_dir):
    """(thread engine, its logger, process engine, its logger), one config."""
    thread_log, process_log = RecordingLogger(), RecordingLogger()
    thread = AsyncLLMEngine.from_kwargs(model_dir, [thread_log], **ENGINE)
    process = ProcessLLMEngine.from_kwargs(model_dir, [process_log], **ENGINE)
    yield thread, thread_log, process, process_log
    thread.shutdown()
    process.shutdown()


@pytest.fixture(scope="module")
def faulty(model_dir):
    engine = ProcessLLMEngine(EngineConfig.from_kwargs(model_dir, **ENGINE), fault_hook=SlowSampling())
    yield engine
    engine.shutdown()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by a parent that is this test) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_streams_the_thread_engines_tokens_stats_and_cache(engines, prompt_ids, hf_reference):
    thread, thread_log, process, process_log = engines
    story = "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who "
    prompts = [story * 2 + str(i) for i in range(3)]  # full blocks, a shared prefix: prefix-cache hits

    async def run(engine, tag):
        ref = await asyncio.gather(*[collect(engine, GenerateRequest(f"{tag}-hf{i}", prompt=p,
                                                                     sampling_params=SamplingParams(temperature=0.0, max_tokens=24)))
                                     for i, p in enumerate(prompt_ids)])
        first = await collect(engine, GenerateRequest(f"{tag}-0", prompt=prompts[0], sampling_params=GREEDY))
        rest = await asyncio.gather(*[collect(engine, GenerateRequest(f"{tag}-{i}", prompt=p, sampling_params=GREEDY))
                                      for i, p in enumerate(prompts[1:], 1)])
        await wait_idle(engine)
        return ref, [first, *rest]

    ref, by_process = asyncio.run(run(process, "p"))
    _, by_thread = asyncio.run(run(thread, "t"))
    assert [tokens for _, tokens, _ in ref] == hf_reference
    assert [(text, tokens) for text, tokens, _ in by_process] == [(text, tokens) for text, tokens, _ in by_thread]
    for _, tokens, last in by_process:
        assert last.finished and last.metrics.ttft_s > 0 and last.metrics.num_generation_tokens == len(tokens)

    # every step's stats and every finished request reached the parent's logger, in order
    wait_for(lambda: len(process_log.finished) == len(thread_log.finished), 10, 0.05, "the last finished requests' stats")
    steps = process_log.steps
    assert [s.step_index for s in steps] == list(range(len(steps)))
    assert sum(s.num_decode_tokens for s in steps) + len(prompts) + len(prompt_ids) == sum(
        len(t) for _, t, _ in by_process + ref)  # every token but each request's first was decoded
    assert sorted((r, m.num_prompt_tokens, m.num_generation_tokens, m.num_cached_tokens) for r, m in process_log.finished) == \
        sorted((r, m.num_prompt_tokens, m.num_generation_tokens, m.num_cached_tokens) for r, m in thread_log.finished)
    assert any(m.num_cached_tokens > 0 for _, m in process_log.finished)  # the later stories hit the first one's blocks

    # the parent's mirror of the prefix cache holds what the child's cache holds (the thread engine's)
    assert process.kv_events.snapshot()[1] == thread.kv_events.snapshot()[1] != []
    cached = {rid.split("-", 1)[1]: (c, p) for rid, c, p in process.kv_events.finished_since(0)[1]}
    assert cached == {rid.split("-", 1)[1]: (c, p) for rid, c, p in thread.kv_events.finished_since(0)[1]}
    # the step-cost fit comes from the child's steps
    assert process.step_cost() == fit_step_cost([(s.num_prefill_tokens, s.num_decode_tokens, s.step_duration_s)
                                                 for s in steps[-256:] if s.step_duration_s > 0]) is not None
    assert process.seconds_without_progress() == 0.0


@pytest.mark.parametrize("fields,name", [({"prompt": ""}, "prompt"), ({"prompt": [10**9]}, "prompt"), ({"messages": ()}, "messages")])
def test_bad_input_fails_in_the_caller_and_the_engine_serves_on(engines, fields, name):
    process = engines[2]

    async def main():
        good = asyncio.create_task(collect(process, GenerateRequest(f"good-{name}-{len(str(fields))}", prompt="Hello",
                                                                    sampling_params=GREEDY)))
        with pytest.raises(ValueError, match=rf"^{name}:"):
            await collect(process, GenerateRequest("bad", sampling_params=GREEDY, **fields))
        _, tokens, last = await good
        assert last.finished and len(tokens) == GREEDY.max_tokens
        await wait_idle(process)

    asyncio.run(main())


def test_a_request_that_cannot_reach_the_child_fails_alone(engines):
    """Requests are encoded in the caller: one that cannot be (any field pickle refuses) fails there, leaves
    nothing counted, and the next request is served (not stuck behind it in the writer)."""
    process = engines[2]
    bad = GenerateRequest("unsendable", prompt="Hello", sampling_params=GREEDY)
    object.__setattr__(bad, "user", lambda: None)

    async def main():
        with pytest.raises(RequestFailedError, match="^prepare failed: it cannot be sent"):
            await asyncio.wait_for(collect(process, bad), 10)
        assert process.load().num_pending_prompt_tokens == 0
        _, tokens, last = await asyncio.wait_for(collect(process, GenerateRequest("after-unsendable", prompt="Hello",
                                                                                  sampling_params=GREEDY)), 30)
        assert last.finished and len(tokens) == GREEDY.max_tokens
        await wait_idle(process)
        assert process.seconds_without_progress() == 0.0

    asyncio.run(main())


def test_abort_frees_every_block_before_it_returns(engines):
    process = engines[2]

    async def main():
        stream = process.generate(GenerateRequest("to-abort", prompt="Tell me a long story.", sampling_params=LONG))
        bystander = asyncio.create_task(collect(process, GenerateRequest("bystander", prompt="Hi", sampling_params=GREEDY)))
        n = 0
        async for _ in stream:
            n += 1
            if n == 5:
                break
        assert not idle(process)
        await stream.aclose()  # what a disconnecting client does
        _, tokens, _ = await bystander
        assert len(tokens) == GREEDY.max_tokens
        await wait_idle(process)
        stream = process.generate(GenerateRequest("to-abort-2", prompt="Another story.", sampling_params=LONG))
        await stream.__anext__()
        await process.abort("to-abort-2")
        assert idle(process)  # the frame that answered the abort carries the load after it
        await stream.aclose()
        await process.abort("never-sent")  # unknown: returns

    asyncio.run(main())


@pytest.mark.parametrize("stage, after", [(Stage.PREPARE, 0), (Stage.SAMPLE, 5), (Stage.DETOKENIZE, 3)])
def test_a_fault_in_the_child_ends_its_request_alone(faulty, stage, after):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def main():
        reference = await collect(faulty, GenerateRequest(f"ref-{stage}", prompt="Once upon a time", sampling_params=params))
        neighbour = asyncio.create_task(collect(faulty, GenerateRequest(f"n-{stage}", prompt="Once upon a time", sampling_params=params)))
        with pytest.raises(RequestFailedError, match=f"^{stage} failed") as failure:
            await collect(faulty, GenerateRequest(f"f-{stage}", prompt="Say something", sampling_params=params,
                                                  user=fault_user(stage, after)))
        assert failure.value.stage == stage
        assert (await neighbour)[1] == reference[1]
        await wait_idle(faulty)
        faulty.check_health()

    asyncio.run(main())


def test_heartbeat_grows_only_while_a_step_is_slow(faulty):
    async def main():
        await wait_idle(faulty)
        await asyncio.to_thread(wait_for, lambda: faulty.seconds_without_progress() == 0.0, 10, 0.05, "an idle child")
        task = asyncio.ensure_future(collect(faulty, GenerateRequest("slow-1", prompt="Hi", sampling_params=GREEDY)))
        await asyncio.to_thread(wait_for, lambda: faulty.seconds_without_progress() > 1.0, SLOW_STEP_S + 10, 0.05, "a stalled heartbeat")
        _, tokens, last = await asyncio.wait_for(task, 30)
        assert last.finished and len(tokens) == GREEDY.max_tokens
        await wait_idle(faulty)
        await asyncio.to_thread(wait_for, lambda: faulty.seconds_without_progress() == 0.0, 10, 0.05, "an idle child")

    asyncio.run(main())


def test_a_killed_child_fails_every_caller_at_once(model_dir):
    engine = ProcessLLMEngine.from_kwargs(model_dir, **ENGINE)

    async def main():
        streams = [engine.generate(GenerateRequest(f"k{i}", prompt="Count to a thousand.", sampling_params=LONG)) for i in range(3)]
        for stream in streams:
            await stream.__anext__()  # each has a token: running in the child
        os.kill(engine.pid, signal.SIGKILL)  # what the kernel's OOM killer does
        for stream in streams:
            with pytest.raises(EngineDeadError, match="exit code -9"):
                async for _ in stream:
                    pass
        with pytest.raises(EngineDeadError):
            engine.check_health()
        with pytest.raises(EngineDeadError):  # a new request fails at once, never at its timeout
            await asyncio.wait_for(collect(engine, GenerateRequest("after", prompt="Hi", sampling_params=GREEDY)), 5)
        await asyncio.wait_for(engine.abort("k0"), 5)  # nothing to wait for

    asyncio.run(main())
    engine.shutdown()


def test_a_failing_stat_logger_ends_the_engine_and_its_child(model_dir):
    class Broken:
        def record(self, scheduler_stats, finished):
            if scheduler_stats is not None and scheduler_stats.step_index == 3:
                raise RuntimeError("exporter broke")

    engine = ProcessLLMEngine.from_kwargs(model_dir, [Broken()], **ENGINE)

    async def main():
        with pytest.raises(EngineDeadError, match="exporter broke"):
            await asyncio.wait_for(collect(engine, GenerateRequest("x", prompt="Hi", sampling_params=LONG)), 30)

    asyncio.run(main())
    with pytest.raises(EngineDeadError):
        engine.check_health()
    wait_for(lambda: not alive(engine.pid), 10, 0.05, "the child to be killed")
    engine.shutdown()


def test_shutdown_ends_open_streams_and_the_child(model_dir):
    engine = ProcessLLMEngine.from_kwargs(model_dir, **ENGINE)
    pid = engine.pid

    async def main():
        stream = engine.generate(GenerateRequest("long", prompt="Hi", sampling_params=LONG))
        await stream.__anext__()
        engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await collect(engine, GenerateRequest("after", prompt="Hi", sampling_params=GREEDY))

    asyncio.run(main())
    assert not alive(pid)
    engine.shutdown()  # idempotent


def test_a_child_that_cannot_start_says_why(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a model directory without a model
    with pytest.raises(RuntimeError, match="failed to start"):
        ProcessLLMEngine(EngineConfig.from_kwargs(str(tmp_path)))
