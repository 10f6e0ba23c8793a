"""Structured outputs, logit_bias and echo through a real Ray Serve deployment (one native replica),
driven by the official `openai` client: outputs parse and validate, streamed and not; bad input is a
400 naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.serving.conftest import (
    MODEL_DIR,
    MODEL_NAME,
    app_args,
    assert_error_body,
    serve_app,
)

ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "price": {"type": "integer", "minimum": 1, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "price", "tags"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a product for sale as JSON."}]


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir):
    with serve_app(ray_cluster, app_args(num_replicas=1, engine={"max_num_seqs": 16})) as served:
        yield served


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.mark.parametrize("seed", [None, 5])
def test_chat_json_schema(client, seed):
    kwargs = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                         max_tokens=120, **kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), ITEM)


def test_chat_json_schema_streamed_equals_unstreamed(client):
    full = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                          max_tokens=120, temperature=0.0)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                                 max_tokens=120, temperature=0.0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    jsonschema.validate(json.loads(text), ITEM)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_chat_json_object_and_structured_outputs_on_chat(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Is water wet? Answer yes or no."}],
                                         max_tokens=10, temperature=0.0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].message.content in ("yes", "no")


def test_completions_choice_and_regex(client):
    animals = ["cat", "dog", "sea otter"]
    out = client.completions.create(model=MODEL_NAME, prompt="My favourite animal is the", max_tokens=10, temperature=0.0, n=2,
                                    seed=3, extra_body={"structured_outputs": {"choice": animals}})
    assert [c.text in animals for c in out.choices] == [True, True]
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
    out = client.completions.create(model=MODEL_NAME, prompt="Today's date is", max_tokens=16, temperature=0.0,
                                    extra_body={"structured_outputs": {"regex": date}})
    assert re.fullmatch(date, out.choices[0].text) and out.choices[0].finish_reason == "stop"


def test_logit_bias(client, tokenizer):
    forced = tokenizer.encode(" banana")[0]
    out = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=3, temperature=0.0,
                                    logit_bias={str(forced): 100})
    assert out.choices[0].text == tokenizer.decode([forced] * 3)
    plain = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=1, temperature=0.0)
    first = tokenizer.encode(plain.choices[0].text)[0]
    banned = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=1, temperature=0.0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].text != plain.choices[0].text


def test_echo(client, tokenizer):
    plain = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=0.0)
    echoed = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=0.0, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    ids = tokenizer.encode("Once upon a time")
    streamed = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0.0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == tokenizer.decode(ids) + plain.choices[0].text


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/completions", {"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ("/v1/completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
])
def test_bad_input_is_a_400_naming_the_field(http, path, extra, param):
    body = {"model": MODEL_NAME, "max_tokens": 4, **extra}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "Hello"})
    error = assert_error_body(http.post(path, json=body), 400, param=param)
    if "objectx" in json.dumps(extra):
        assert "objectx" in error["message"] and "/project/" not in error["message"]
