"""Every request field is bounded: values past a bound are a 400 naming the field (through the API
models and `SamplingParams`), never an engine crash; model-dependent bounds (top_k, text that cannot
fit the context) are applied by the engine's `InputProcessor`, which both backends run."""

from __future__ import annotations

import json
import math
import time

import pytest
from pydantic import ValidationError

from serve_app.request_limits import INT64_MAX, INT64_MIN, MAX_STOP_STRINGS, MAX_USER_CHARS, wrap_int64
from serve_app.serving.errors import to_api_error, validation_error
from serve_app.serving.openai_protocol import ChatCompletionRequest, CompletionRequest
from serve_app.types import GenerateRequest, SamplingParams
from tests.serving.conftest import MODEL_DIR

BIG = 2**63


def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def param_error(body: dict, kind=ChatCompletionRequest) -> tuple[str | None, str]:
    """(param, message) of the 400 a body gets from the API models and `sampling_params()`."""
    try:
        req = kind.model_validate(body)
        req.validate_supported(8)
        req.sampling_params(0)
    except ValidationError as exc:
        error = validation_error(exc.errors())
        return error.param, error.message
    except ValueError as exc:
        error = to_api_error(exc)
        assert error.status == 400
        return error.param, error.message
    return None, ""


@pytest.mark.parametrize("body, param", [
    (chat(seed=BIG), "seed"),
    (chat(seed=-BIG - 1), "seed"),
    (chat(top_k=-5), "top_k"),
    (chat(max_tokens=BIG), "max_tokens"),
    (chat(min_tokens=BIG), "min_tokens"),
    (chat(temperature=1e308), "temperature"),
    (chat(temperature=math.nan), "temperature"),
    (chat(top_p=math.inf), "top_p"),
    (chat(presence_penalty=math.nan), "presence_penalty"),
    (chat(repetition_penalty=math.inf), "repetition_penalty"),
    (chat(repetition_penalty=1e300), "repetition_penalty"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    (chat(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"),
    (chat(stop=["x" * 10_000]), "stop"),
    (chat(stop_token_ids=[1] * 10_000), "stop_token_ids"),
    (chat(user="u" * (MAX_USER_CHARS + 1)), "user"),
    (chat(model="m" * 100_000), "model"),
    (chat(messages=[{"role": "user", "content": "hi"}] * 10_000), "messages"),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 1000}]), "messages.0.content"),
    (chat(metadata={str(i): "v" for i in range(100)}), "metadata"),
    (chat(logit_bias={str(i): 1.0 for i in range(301)}), "logit_bias"),
    (chat(logit_bias={"50": 1e9}), "logit_bias"),
])
def test_out_of_bounds_is_a_400_naming_the_field(body, param):
    got, message = param_error(body)
    assert got == param, message
    assert message.startswith(param.split(".")[0]) or param in message


def test_completion_bounds():
    assert param_error({"model": "m", "prompt": "hi", "top_k": BIG}, CompletionRequest) == (None, "")
    assert param_error({"model": "m", "prompt": "hi", "logprobs": 21}, CompletionRequest)[0] == "logprobs"
    assert param_error({"model": "m", "prompt": "hi", "seed": BIG}, CompletionRequest)[0] == "seed"


def test_in_bounds_values_pass_and_seeds_wrap_per_choice():
    assert param_error(chat(seed=INT64_MAX, n=3, top_k=BIG, stop=["a"] * MAX_STOP_STRINGS)) == (None, "")
    req = ChatCompletionRequest.model_validate(chat(seed=INT64_MAX, n=2))
    assert [req.sampling_params(j).seed for j in range(2)] == [INT64_MAX, INT64_MIN]
    assert wrap_int64(INT64_MIN - 1) == INT64_MAX


def test_sampling_params_reject_non_finite_and_huge_values():
    for kwargs in ({"temperature": math.inf}, {"top_p": math.nan}, {"frequency_penalty": -math.inf},
                   {"seed": BIG}, {"max_tokens": BIG}, {"min_tokens": -1}, {"top_k": 1.5}, {"logprobs": True}):
        with pytest.raises(ValueError, match=f"^{next(iter(kwargs))}:"):
            SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def input_processor():
    from serve_app.input_processor import InputProcessor

    if not (MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip("no model (make model)")
    return InputProcessor(str(MODEL_DIR), 49152, 2048)


def test_top_k_beyond_the_vocabulary_keeps_every_token(input_processor):
    request = GenerateRequest("r", prompt="hi", sampling_params=SamplingParams(top_k=BIG, max_tokens=4))
    assert input_processor.process(request).sampling_params.top_k == 0
    kept = GenerateRequest("r", prompt="hi", sampling_params=SamplingParams(top_k=40, max_tokens=4))
    assert input_processor.process(kept).sampling_params.top_k == 40


def test_text_that_cannot_fit_is_rejected_before_tokenizing(input_processor):
    limit = input_processor.max_prompt_chars
    assert limit is not None and limit >= input_processor.max_model_len
    huge = "word " * (limit // 5 + 10)
    for request in (GenerateRequest("a", prompt=huge), GenerateRequest("b", messages=({"role": "user", "content": huge},))):
        start = time.perf_counter()
        with pytest.raises(ValueError, match="characters cannot fit the context") as info:
            input_processor.process(request)
        assert time.perf_counter() - start < 0.1  # tokenizing it would take seconds
        assert str(info.value).split(":")[0] in ("prompt", "messages")


def test_one_long_stop_string_is_not_a_list_of_too_many():
    assert param_error(chat(stop="x" * 200)) == (None, "")


def test_every_body_within_the_documented_bounds_is_accepted(input_processor):
    """The fuzzer's valid bodies (tests/serving/api_fuzz.py), without a server: the API models and the
    engine's InputProcessor accept every one (each refusal would be a bound stricter than documented)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from tests.serving.api_fuzz import valid_chat_bodies, valid_completion_bodies

    @settings(max_examples=300, deadline=None, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.one_of(valid_chat_bodies("m").map(lambda b: (ChatCompletionRequest, b)),
                     valid_completion_bodies("m").map(lambda b: (CompletionRequest, b))))
    def accepted(kind_body):
        kind, body = kind_body
        req = kind.model_validate(json.loads(json.dumps(body)))  # as it arrives: through JSON
        req.validate_supported(8)
        prompts = [None] if kind is ChatCompletionRequest else req.prompts()
        for prompt in prompts:
            for j in range(req.n):
                request = (GenerateRequest("r", messages=req.engine_messages(), sampling_params=req.sampling_params(j))
                           if prompt is None else GenerateRequest("r", prompt=prompt, sampling_params=req.sampling_params(j)))
                input_processor.process(request)

    accepted()
