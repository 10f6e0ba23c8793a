"""The native backend and the LLMServer replica class in-process (real engine, no Ray cluster):
streaming deltas, routing stats, abort on early exit, input errors, and engine death → unhealthy."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest

from serve_app.backends import BackendDeadError, make_backend
from serve_app.backends.native import NativeBackend
from serve_app.serving.config import ServeConfig
from serve_app.serving.llm_server import GenerationChunk, LLMServer
from serve_app.types import FinishReason, GenerateRequest, SamplingParams

pytestmark = pytest.mark.heavy  # the real model behind the backend and the replica class: make test, not make test-fast

NUM_BLOCKS = 64


def config(model_dir: str, core_process: bool = False, **kwargs) -> ServeConfig:
    engine = {"dtype": "float32", "num_blocks": NUM_BLOCKS, "max_num_seqs": 8, "core_process": core_process}
    return ServeConfig(model=model_dir, engine=engine, **kwargs)


async def collect(backend, request):
    return [out async for out in backend.generate(request)]


def load(stats):
    """The load fields of routing stats (without the step-cost fit, which changes as steps run)."""
    return dataclasses.replace(stats, step_fixed_s=0.0, prefill_s_per_token=0.0, decode_s_per_token=0.0)


@pytest.mark.parametrize("core_process", [False, True], ids=["engine-thread", "engine-process"])
def test_backend_streams_deltas_and_reports_load(model_dir, core_process):
    async def main():
        backend = make_backend(config(model_dir, core_process).backend_config)
        assert isinstance(backend, NativeBackend)
        await backend.start()
        try:
            idle = backend.routing_stats()
            assert idle.num_free_blocks == idle.num_total_blocks == NUM_BLOCKS
            assert idle.kv_cache_usage == 0.0 and idle.num_running == idle.num_waiting == 0
            assert set(idle.as_dict()) == {"kv_cache_usage", "num_free_blocks", "num_total_blocks", "num_waiting", "num_running",
                                           "num_pending_prompt_tokens", "step_fixed_s", "prefill_s_per_token", "decode_s_per_token"}
            assert idle.prefill_s_per_token == 0  # no step-cost fit before any step
            assert idle.num_pending_prompt_tokens == 0
            info = backend.model_info()
            assert info.name == "smollm2-135m-instruct" and info.max_model_len == NUM_BLOCKS * 16

            outs = await collect(backend, GenerateRequest("a", prompt="Once upon a time",
                                                          sampling_params=SamplingParams(temperature=0, max_tokens=6)))
            assert len(outs) >= 2 and outs[-1].finished and outs[-1].finish_reason == FinishReason.LENGTH
            assert sum(len(o.token_ids) for o in outs) == 6
            assert not any(o.finished for o in outs[:-1])

            # leaving the iteration early aborts the request and frees its blocks
            stream = backend.generate(GenerateRequest("b", prompt="Tell me a long story.",
                                                      sampling_params=SamplingParams(max_tokens=500, ignore_eos=True)))
            admitted = await stream.__anext__()  # validated and queued: no token yet
            assert admitted.token_ids == () and not admitted.finished and admitted.num_prompt_tokens > 0
            await stream.__anext__()  # the first token
            busy = backend.routing_stats()
            assert busy.num_free_blocks < NUM_BLOCKS and busy.num_running == 1 and busy.kv_cache_usage > 0
            assert busy.num_pending_prompt_tokens == 0  # it has its first token: decoding, nothing left to read
            await stream.aclose()
            for _ in range(100):
                if backend.routing_stats().num_free_blocks == NUM_BLOCKS:
                    break
                await asyncio.sleep(0.02)
            assert load(backend.routing_stats()) == idle

            # explicit abort of a running request
            task = asyncio.ensure_future(collect(backend, GenerateRequest("c", prompt="Count to a thousand.",
                                                                          sampling_params=SamplingParams(max_tokens=500, ignore_eos=True))))
            while backend.routing_stats().num_running == 0:
                await asyncio.sleep(0.01)
            await backend.abort("c")
            outs = await asyncio.wait_for(task, 10)
            assert outs[-1].finish_reason == FinishReason.ABORT
            assert backend.routing_stats().num_free_blocks == NUM_BLOCKS

            # bad input: ValueError naming the field, nothing queued
            with pytest.raises(ValueError, match=r"^prompt:"):
                await collect(backend, GenerateRequest("d", prompt="x " * (NUM_BLOCKS * 16 + 10)))
            assert load(backend.routing_stats()) == idle
            # the replica's own step-cost fit is published once it has seen enough steps
            fitted = backend.routing_stats()
            assert fitted.prefill_s_per_token > 0 and fitted.decode_s_per_token > 0
            backend.check_health()
        finally:
            backend.shutdown()
            backend.shutdown()  # idempotent
        with pytest.raises(BackendDeadError):
            backend.check_health()

    asyncio.run(main())


@pytest.mark.cluster  # the replica class reads Ray's runtime context: that starts a local Ray
@pytest.mark.parametrize("core_process", [False, True], ids=["engine-thread", "engine-process"])
def test_llm_server_replica_health_and_engine_death(model_dir, core_process):
    """The replica class as Serve drives it: stats, chunks, then a dying engine loop (or a killed
    engine process) fails requests with BackendDeadError and makes check_health raise (so Serve
    replaces the replica)."""

    async def main():
        cls = LLMServer.func_or_class
        server = cls.__new__(cls)
        await server.__init__(config(model_dir, core_process, torch_num_threads=0))
        import torch

        assert os.environ["OMP_NUM_THREADS"] == str(os.cpu_count())  # what an engine process reads
        if not core_process:
            assert torch.get_num_threads() == os.cpu_count()
        try:
            stats = server.record_routing_stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"] == NUM_BLOCKS
            assert stats["kv_snapshot"] == [] and stats["kv_block_size"] == 16  # the first poll: a full (empty) snapshot
            assert server.model_info().max_model_len == NUM_BLOCKS * 16
            request = GenerateRequest("r1", messages=({"role": "user", "content": "What is the capital of France?"},),
                                      sampling_params=SamplingParams(temperature=0, max_tokens=16))
            chunks = [c async for c in server.generate(request)]
            assert all(isinstance(c, GenerationChunk) for c in chunks)
            assert "".join(c.text for c in chunks) == "The capital of France is Paris."
            assert chunks[-1].finished and chunks[-1].finish_reason == "stop" and chunks[-1].num_prompt_tokens > 10
            # the next poll publishes the blocks the request cached, and what the engine found cached for it
            update = server.record_routing_stats()
            stored = [key for _, is_stored, key in update.get("kv_events", []) if is_stored] or update.get("kv_snapshot", [])
            num_tokens = chunks[-1].num_prompt_tokens + sum(len(c.token_ids) for c in chunks)
            assert chunks[-1].num_prompt_tokens // 16 <= len(stored) <= num_tokens // 16  # full blocks of prompt + output
            assert update["cached_tokens"] == [("r1", 0, chunks[-1].num_prompt_tokens)]
            server.check_health()

            if core_process:  # the engine process is killed (as the kernel's OOM killer would)
                os.kill(server.backend.engine.pid, signal.SIGKILL)
            else:  # the engine loop dies at its next step
                engine = server.backend.engine.engine

                def broken_step():
                    raise RuntimeError("simulated device failure")

                engine.step = broken_step
            with pytest.raises(BackendDeadError):
                async for _ in server.generate(GenerateRequest("r2", prompt="Hello", sampling_params=SamplingParams(max_tokens=4))):
                    pass
            with pytest.raises(BackendDeadError):
                server.check_health()
            with pytest.raises(BackendDeadError):  # new requests fail fast instead of hanging
                async for _ in server.generate(GenerateRequest("r3", prompt="Hello")):
                    pass
        finally:
            server.__del__()

    asyncio.run(main())


def test_llm_server_health_fails_while_a_step_hangs(model_dir):
    """A step that never finishes (thread alive) fails the health check after `engine_stall_timeout_s`
    while work is pending; an idle engine never does."""
    import threading

    from tests.polling import wait_for

    async def main():
        cls = LLMServer.func_or_class
        server = cls.__new__(cls)
        await server.__init__(config(model_dir, engine_stall_timeout_s=0.5))
        runner = server.backend.engine.engine.core.model_runner
        original, release = runner.execute_model, threading.Event()

        def hung(scheduler_output):
            release.wait(60)
            return original(scheduler_output)

        try:
            await asyncio.sleep(1.0)
            server.check_health()  # idle for longer than the bound: healthy
            runner.execute_model = hung
            task = asyncio.ensure_future(collect(server, GenerateRequest("h", prompt="Hi", sampling_params=SamplingParams(max_tokens=3))))

            def unhealthy():
                try:
                    server.check_health()
                except BackendDeadError as exc:
                    return str(exc)
                return None

            message = await asyncio.to_thread(wait_for, unhealthy, 30, 0.05, "a failing health check")
            assert message.startswith("engine stalled") and "engine_stall_timeout_s=0.5" in message
            release.set()
            chunks = await asyncio.wait_for(task, 30)
            assert chunks[-1].finished and chunks[-1].finish_reason == "length"
            server.check_health()
        finally:
            release.set()
            server.__del__()

    asyncio.run(main())


def test_llm_server_drain_finishes_short_requests_and_aborts_the_rest(model_dir):
    async def main():
        cls = LLMServer.func_or_class
        server = cls.__new__(cls)
        await server.__init__(config(model_dir))
        runner = server.backend.engine.engine.core.model_runner
        original = runner.execute_model

        def paced(scheduler_output):  # >= 20 ms a step: the long request cannot finish within the drain
            time.sleep(0.02)
            return original(scheduler_output)

        runner.execute_model = paced
        try:
            short = asyncio.ensure_future(collect(server, GenerateRequest("short", prompt="Hi", sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))))
            long = asyncio.ensure_future(collect(server, GenerateRequest("long", prompt="Hi", sampling_params=SamplingParams(max_tokens=1000, ignore_eos=True))))
            while server.routing_stats()["num_running"] < 2:
                await asyncio.sleep(0.01)
            assert await server.drain(timeout_s=5.0) == 1  # the long one is still running at the deadline
            short_chunks, long_chunks = await asyncio.wait_for(asyncio.gather(short, long), 30)
            assert short_chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in short_chunks) == 4
            assert long_chunks[-1].finished and long_chunks[-1].finish_reason == "abort"
            stats = server.routing_stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == 0  # KV freed
            server.backend.engine.engine.core.block_manager.check_integrity()
            assert await server.drain(timeout_s=5.0) == 0  # nothing in flight: returns at once
        finally:
            server.__del__()

    asyncio.run(main())
