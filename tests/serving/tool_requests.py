"""Tool-calling requests as the API builds them, for tests that drive an engine or backend directly:
an OpenAI chat body → the `GenerateRequest` (rendered messages, the mode's constraint) and reading
the output back into content and calls."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from serve_app.serving.openai_protocol import ChatCompletionRequest
from serve_app.serving.tool_output import ToolCallState
from serve_app.serving.tool_parser import make_extractor
from serve_app.serving.tool_prompt import render_chat
from serve_app.serving.tools import ToolRequest
from serve_app.types import GenerateRequest


def tool_request(request_id: str, body: dict[str, Any], template_renders: bool = False) -> tuple[GenerateRequest, ToolRequest]:
    chat = ChatCompletionRequest.model_validate({"model": "m", **body})
    chat.validate_supported(max_n=8)
    tools = chat.tool_request()
    messages, template_tools = render_chat(chat.engine_messages(), tools, template_renders)
    params = tools.sampling_params(chat.sampling_params())
    return GenerateRequest(request_id, messages=messages, tools=template_tools, sampling_params=params), tools


def read_calls(tools: ToolRequest, text: str) -> ToolCallState:
    state = ToolCallState(make_extractor(tools))
    state.feed(text, True)
    return state


def validated_calls(tools: ToolRequest, text: str) -> list[tuple[str, dict]]:
    """(name, arguments) of each call in `text`, every arguments parsed and validated against its tool's schema."""
    out = []
    for call in read_calls(tools, text).message().get("tool_calls", []):
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, tools.tool(call["function"]["name"]).parameters)
        out.append((call["function"]["name"], arguments))
    return out
