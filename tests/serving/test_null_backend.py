"""The null backend (serve_app/backends/null.py): its name and options, tokens and text, batching, stats, aborts.

In-process, no Ray: the backend is driven through the `Backend` interface as an LLMServer replica
drives it, with the repository's real tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from serve_app.backends import make_backend
from serve_app.backends.null import NullBackend, NullEngineOptions
from serve_app.serving.config import ServeConfig
from serve_app.types import FinishReason, GenerateRequest, SamplingParams
from tests.recording_logger import RecordingLogger

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"


def config(backend: str = "null", **engine) -> ServeConfig:
    return ServeConfig(model=str(MODEL_DIR), backend=backend, engine=engine)


def request(rid: str, max_tokens: int, prompt: str | list[int] = "Hello there") -> GenerateRequest:
    return GenerateRequest(rid, prompt=prompt, sampling_params=SamplingParams(max_tokens=max_tokens))


def test_the_name_or_the_import_path_selects_it_and_its_options_are_validated():
    for backend in ("null", "serve_app.backends.null:NullBackend"):  # a plugin backend is named by import path
        cfg = config(backend, step_time_s=0.005, max_num_seqs=8, block_size=32)
        assert cfg.backend_config.options == NullEngineOptions(step_time_s=0.005, max_num_seqs=8, block_size=32)
        assert cfg.backend_config.kv_block_size == 32 and cfg.backend_config.device == "none"
        assert isinstance(make_backend(cfg.backend_config), NullBackend)
    with pytest.raises(ValueError, match="^step_time_s:"):
        config(step_time_s=0)
    with pytest.raises(ValueError, match="^dtype: not a null-engine option"):
        config(dtype="bfloat16")
    with pytest.raises(ValueError, match="^backend: .* is not a Backend class"):
        ServeConfig(model=str(MODEL_DIR), backend="serve_app.serving.config:ServeConfig")
    with pytest.raises(ValueError, match="^backend: cannot import"):
        ServeConfig(model=str(MODEL_DIR), backend="no_such_module:Backend")
    with pytest.raises(ValueError, match="^backend: must be one of"):
        ServeConfig(model=str(MODEL_DIR), backend="nul")


async def collect(backend: NullBackend, req: GenerateRequest) -> list:
    return [out async for out in backend.generate(req)]


@contextlib.asynccontextmanager
async def started(**engine):
    """A started null backend with these `engine` options, and a recording stat logger; shut down after."""
    stats = RecordingLogger()
    backend = NullBackend.from_config(config(**engine).backend_config, [stats])
    await backend.start()
    try:
        yield backend, stats
    finally:
        backend.shutdown()


def test_streams_real_text_in_batches_with_stats_and_frees_every_block():
    async def run():
        async with started(step_time_s=0.001, max_num_seqs=3, num_blocks=64) as (backend, stats):
            results = await asyncio.gather(*(collect(backend, request(f"r{i}", 5 + i)) for i in range(5)))
            return backend, stats, results, backend.routing_stats()

    backend, stats, results, load = asyncio.run(run())
    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    for i, outs in enumerate(results):
        admitted, outs = outs[0], outs[1:]  # first the empty delta that says "queued", like every backend's
        assert admitted.token_ids == () and not admitted.finished
        ids = [t for o in outs for t in o.token_ids]
        assert len(ids) == 5 + i and all(len(o.token_ids) == 1 for o in outs)  # one token per step
        assert "".join(o.text for o in outs) == tokenizer.decode(ids)  # the tokenizer's own text
        assert [o.finished for o in outs] == [False] * (4 + i) + [True]
        assert outs[-1].finish_reason == FinishReason.LENGTH
        assert outs[-1].metrics.num_generation_tokens == 5 + i and outs[-1].metrics.ttft_s >= 0
        assert outs[0].num_prompt_tokens == len(tokenizer.encode("Hello there", add_special_tokens=False).ids)
    assert len({tuple(t for o in outs for t in o.token_ids) for outs in results}) == 5  # each its own text
    assert max(s.num_scheduled_seqs for s in stats.steps) == 3  # max_num_seqs bounds the batch
    assert any(s.num_waiting > 0 for s in stats.steps)
    assert sum(s.num_decode_tokens for s in stats.steps) == sum(5 + i for i in range(5))
    assert sorted(m.num_generation_tokens for _, m in stats.finished) == [5, 6, 7, 8, 9]
    assert (load.num_free_blocks, load.num_running, load.num_waiting) == (64, 0, 0)


def test_leaving_a_stream_aborts_it_and_frees_its_blocks_and_bad_input_is_rejected():
    async def run():
        async with started(step_time_s=0.001, num_blocks=64, block_size=4) as (backend, stats):
            with pytest.raises(ValueError, match="^prompt:"):
                await collect(backend, request("bad", 4, prompt=[]))
            stream = backend.generate(request("long", 1000, prompt=list(range(40))))
            async with contextlib.aclosing(stream):
                await anext(stream)  # queued
                await anext(stream)  # the first token: running
                busy = backend.routing_stats()
            for _ in range(1000):  # the engine thread takes the abort in between steps
                if backend.routing_stats().num_running == 0:
                    break
                await asyncio.sleep(0.005)
            return busy, backend.routing_stats(), stats.finished

    busy, after, finished = asyncio.run(run())
    assert busy.num_running == 1 and busy.num_free_blocks <= 64 - 11  # 40 prompt tokens + 1 in 4-token blocks
    assert (after.num_running, after.num_free_blocks) == (0, 64)
    assert [reason for reason, _ in finished] == [FinishReason.ABORT]
