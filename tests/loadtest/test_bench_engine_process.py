"""The engine-placement benchmark: the engine in a process of its own streams what the engine thread
streams (same text, in order, every stream ends), and the summary pairs each repeat's runs."""

from __future__ import annotations

import asyncio
import os

import pytest

from loadtest import bench_engine_process
from loadtest.bench_engine import make_prompts
from loadtest.bench_engine_process import StreamingEngine, omp_env, summarize
from tests.serving.conftest import MODEL_DIR


@pytest.mark.heavy
def test_the_engine_in_its_own_process_streams_what_the_engine_thread_streams():
    prompts = make_prompts(3, 24, 49152, 100, seed=5)
    kwargs = {"dtype": "bfloat16", "max_num_seqs": 8, "kv_cache_memory_gib": 0.1}

    def texts(engine) -> list[str]:
        async def main():
            return await asyncio.gather(*(engine.stream(p, 6) for p in prompts))

        try:
            streams = asyncio.run(main())
        finally:
            engine.close()
        assert [s.tokens for s in streams] == [6, 6, 6] and all(s.end is not None for s in streams)
        return ["".join(s.text) for s in streams]

    process = StreamingEngine("process", str(MODEL_DIR), kwargs)
    assert texts(process) == texts(StreamingEngine("thread", str(MODEL_DIR), kwargs))
    with pytest.raises(ProcessLookupError):  # `close` ended the child (and reaped it)
        os.kill(process.engine.pid, 0)


def test_summary_pairs_runs_by_repeat_within_each_openmp_setting():
    runs = [{"omp": omp, "variant": v, "repeat": r, "output_tok_s": tok_s * scale, "cpu_ms_per_token": 4.0, "ttft_p50_s": 1.0,
             "itl_p50_s": 0.05, "lone_ttft_p50_s": None if v == "offline" else 0.1}
            for omp, scale in (("passive", 1.0), ("default:30", 2.0))
            for r, rates in enumerate([(400, 300, 200), (440, 330, 330)]) for v, tok_s in zip(bench_engine_process.VARIANTS, rates, strict=True)]
    results = {"runs": runs, "workload": {"config": "c", "engine": {}, "omp_settings": ["passive", "default:30"], "repeats": 2,
                                          "concurrency": 32, "prompt_len": 128, "output_len": 64, "ttft_requests": 8}}
    body = "\n".join(summarize(results))
    for omp in ("passive", "default:30"):
        assert results["ratios"][omp]["thread ÷ offline"]["median"] == pytest.approx(0.75)
        assert results["ratios"][omp]["process ÷ thread"] == {"median": pytest.approx((200 / 300 + 1.0) / 2), "min": pytest.approx(200 / 300),
                                                              "max": 1.0, "n": 2}
    assert results["summary"]["passive"]["offline"]["lone_ttft_p50_s"] is None
    assert "| 420.0 (400.0–440.0) |" in body and "| 840.0 (800.0–880.0) |" in body


def test_openmp_settings_become_the_runs_environment():
    assert omp_env("passive") == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert omp_env("default") == {}
    assert omp_env("passive:3000") == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"}
    for bad in ("sleepy", "passive:-1", "passive:many"):
        with pytest.raises(ValueError, match="POLICY"):
            omp_env(bad)
