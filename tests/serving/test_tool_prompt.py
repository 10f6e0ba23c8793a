"""How tools, earlier calls and tool results reach the model (serving/tool_prompt.py), through the real
tokenizer and chat template: SmolLM2's template (which ignores `tools`) gets the generic Hermes-style
format; a template that reads `tools` renders them itself."""

from __future__ import annotations

import json
import shutil

import pytest

from serve_app.input_processor import InputProcessor, template_renders_tools
from serve_app.serving.openai_protocol import ChatCompletionRequest
from serve_app.serving.tool_prompt import TOOLS_SECTION, render_chat

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "24 C"},
]
# a template that renders tools, calls and results itself (Qwen2.5's layout, shortened)
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{%- if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
    "{%- elif m.role == 'tool' %}[{{ m.tool_call_id }}] {{ m.content }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": CONVERSATION, "tools": [WEATHER], **fields})


@pytest.fixture(scope="module")
def smollm(model_dir) -> InputProcessor:
    return InputProcessor(model_dir, 49152, 2048)


@pytest.fixture(scope="module")
def tools_model(model_dir, tmp_path_factory) -> InputProcessor:
    path = tmp_path_factory.mktemp("tools_template")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        shutil.copyfile(f"{model_dir}/{name}", path / name)
    (path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return InputProcessor(str(path), 49152, 2048)


def text_of(processor: InputProcessor, messages, tools) -> str:
    return processor.hf_tokenizer.decode(processor.apply_chat_template(messages, tools))


def test_template_detection(smollm, tools_model):
    assert not template_renders_tools(smollm.hf_tokenizer.chat_template)  # SmolLM2's template ignores tools
    assert template_renders_tools(tools_model.hf_tokenizer.chat_template)
    assert not template_renders_tools(None) and not template_renders_tools("{% if %}")  # unparsable: not rendered by it


def test_generic_format_through_smollm2_template(smollm):
    body = request()
    messages, template_tools = render_chat(body.engine_messages(), body.tool_request(), template_renders=False)
    assert template_tools is None
    section = TOOLS_SECTION.format(tools=json.dumps(WEATHER))
    assert text_of(smollm, messages, template_tools) == (
        f"<|im_start|>system\nBe brief.\n\n{section}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n24 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert '"name": <function-name>' in section and "<tools>\n" in section


def test_generic_format_adds_a_system_message_and_none_hides_the_tools(smollm):
    body = request(messages=[{"role": "user", "content": "Hi"}])
    messages, _ = render_chat(body.engine_messages(), body.tool_request(), template_renders=False)
    assert messages == ({"role": "system", "content": TOOLS_SECTION.format(tools=json.dumps(WEATHER))},
                        {"role": "user", "content": "Hi"})
    hidden = request(tool_choice="none")
    messages, _ = render_chat(hidden.engine_messages(), hidden.tool_request(), template_renders=False)
    assert messages[0] == {"role": "system", "content": "Be brief."}  # earlier calls and results are still shown
    assert "<tool_response>\n18 C" in messages[-1]["content"]


def test_template_that_renders_tools_gets_them(tools_model):
    body = request()
    messages, template_tools = render_chat(body.engine_messages(), body.tool_request(), template_renders=True)
    assert template_tools == (WEATHER,)
    assert text_of(tools_model, messages, template_tools) == (  # (`{%-` eats the newlines before it)
        f"<|im_start|>system\nTOOLS:{json.dumps(WEATHER)}<|im_end|>\n"
        "<|im_start|>systemBe brief.<|im_end|><|im_start|>userWeather in Paris and Rome?<|im_end|>"
        '<|im_start|>assistant<tool_call>get_weather {"city": "Paris"}</tool_call><tool_call>get_weather {"city": "Rome"}'
        "</tool_call><|im_end|><|im_start|>tool[call_1] 18 C<|im_end|><|im_start|>tool[call_2] 24 C<|im_end|>"
        "<|im_start|>assistant\n")
    none = request(tool_choice="none")
    assert render_chat(none.engine_messages(), none.tool_request(), template_renders=True)[1] is None


@pytest.mark.parametrize(("messages", "param", "words"), [
    ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_9", "content": "r"}],
     "messages.1.tool_call_id", "answers no tool call"),
    (CONVERSATION[:3] + [{"role": "user", "content": "x"}, CONVERSATION[3]], "messages.4.tool_call_id", "answers no tool call"),
])
def test_tool_messages_must_answer_a_call(messages, param, words):
    body = request(messages=messages)
    with pytest.raises(ValueError, match=f"^{param}: .*{words}"):
        render_chat(body.engine_messages(), body.tool_request(), template_renders=False)
