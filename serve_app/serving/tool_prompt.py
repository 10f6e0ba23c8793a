"""Tool calling, prompt side: how tools, earlier tool calls and tool results reach the model.

A chat template that reads the `tools` variable renders everything itself: it gets the OpenAI tool
definitions (`apply_chat_template(..., tools=...)`), `tool` messages (with `tool_call_id`) and
assistant messages with `tool_calls` (arguments as objects), as vLLM hands them.

Any other template (SmolLM2's, for one) gets plain messages in the generic, Hermes-style format that
Qwen2.5 and the Hermes models are trained on:
- the tools: a section appended to the first system message (or a new one in front), listing each
  function's definition as one JSON line inside `<tools></tools>` and asking for
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (`TOOLS_SECTION`);
- an assistant message's calls: its text, then one `<tool_call>` block per call;
- `tool` messages: a user message holding each result in `<tool_response>` tags, consecutive results
  in one message (every template knows the user role).
With `tool_choice` "none" the tools are not shown (earlier calls and results still are).

Every `tool` message must answer a call of the assistant message before it (only other `tool`
messages in between), by that call's id, as at OpenAI.
"""

from __future__ import annotations

import json
from typing import Any

from serve_app.serving.tools import ToolRequest

TOOLS_SECTION = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def check_tool_messages(messages: tuple[dict[str, Any], ...]) -> None:
    """Each `tool` message answers a call of the assistant message before it (ValueError naming it)."""
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            if m["tool_call_id"] not in call_ids:
                raise ValueError(f"messages.{i}.tool_call_id: {m['tool_call_id']!r} answers no tool call of the "
                                 "assistant message before it")
        else:
            call_ids = {c["id"] for c in m.get("tool_calls") or ()}


def tools_section(tools: ToolRequest) -> str:
    return TOOLS_SECTION.format(tools="\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools.tools))


def _call_text(call: dict[str, Any]) -> str:
    body = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
    return f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"


def _with_call_text(messages: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    previous_was_tool = False
    for m in messages:
        if m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if previous_was_tool:
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
            previous_was_tool = True
            continue
        previous_was_tool = False
        plain = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if m.get("tool_calls"):
            parts = ([m["content"]] if m["content"] else []) + [_call_text(c) for c in m["tool_calls"]]
            plain["content"] = "\n".join(parts)
        out.append(plain)
    return out


def _with_tools_section(messages: list[dict[str, Any]], tools: ToolRequest | None) -> tuple[dict[str, Any], ...]:
    if tools is None or tools.mode == "none":
        return tuple(messages)
    section = tools_section(tools)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        messages[0] = {**first, "content": f"{first['content']}\n\n{section}" if first["content"] else section}
    else:
        messages.insert(0, {"role": "system", "content": section})
    return tuple(messages)


def render_chat(messages: tuple[dict[str, Any], ...], tools: ToolRequest | None,
                template_renders: bool) -> tuple[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...] | None]:
    """(messages, tool definitions for the template) of a chat request: the template's own format when
    it renders tools (`template_renders`), else the generic one with no definitions for the template."""
    check_tool_messages(messages)
    if template_renders:
        active = tools is not None and tools.mode != "none"
        return messages, tuple(t.as_openai() for t in tools.tools) if active else None
    return _with_tools_section(_with_call_text(messages), tools), None
