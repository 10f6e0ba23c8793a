"""Tool calling, `auto` mode: Hermes-style `<tool_call>...</tool_call>` blocks in free model output.

A block becomes a tool call when its inside is one JSON object `{"name": <one of the request's
functions>, "arguments": <object>}` ("arguments" may be left out: {}; given as a string, that
string must hold a JSON object); with `strict: true` on the function, the arguments must also
validate against its `parameters`. Anything else (malformed JSON, an unknown name, a block never
closed and not a complete call by the end) stays text, tags included: parsing never fails a request.
A block left open at the end of the output counts when its inside is a complete call (generation
stopped at `</tool_call>`, the stop string of `parallel_tool_calls` false).

Streaming: text outside blocks is passed on as it comes, except a tail that may be the start of
`<tool_call>` (held until the next delta tells); a block is held until it closes, then passed on as
one call (`CallStart` + its arguments re-encoded as compact JSON) or as text.
"""

from __future__ import annotations

import json
from typing import Any

from serve_app.serving.tool_output import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    NamedCallExtractor,
    RequiredCallExtractor,
    ToolCallExtractor,
    ToolEvent,
    Trim,
    new_call_id,
)
from serve_app.serving.tools import ToolRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_call(inner: str, tools: ToolRequest) -> tuple[str, str] | None:
    """(name, arguments JSON) of a block's inside, or None when it is not a valid call."""
    try:
        value = json.loads(inner)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or set(value) - {"name", "arguments"}:
        return None
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or name not in tools.names:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict) or not _valid(arguments, tools.tool(name)):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def _valid(arguments: dict[str, Any], tool: Any) -> bool:
    if not tool.strict:
        return True
    from jsonschema import Draft202012Validator

    try:
        return Draft202012Validator(tool.parameters).is_valid(arguments)
    except Exception:  # noqa: BLE001 - e.g. a `$ref` that resolves nowhere (never fetched): not a valid call
        return False


class HermesCallExtractor:
    def __init__(self, tools: ToolRequest) -> None:
        self._tools = tools
        self._buffer = ""
        self._inside = False
        self._scanned = 0  # inside a block: where the search for its end resumes (no rescans: linear time)
        self._num_calls = 0
        self._trim = Trim()  # the content, across the blocks

    def _content(self, text: str) -> list[ToolEvent]:
        piece = self._trim.push(text)
        return [ContentDelta(piece)] if piece else []

    def _block(self, inner: str, closed: bool) -> list[ToolEvent]:
        call = parse_call(inner, self._tools)
        if call is None:
            return self._content(OPEN + inner + (CLOSE if closed else ""))
        index, self._num_calls = self._num_calls, self._num_calls + 1
        return [CallStart(index, new_call_id(), call[0]), ArgumentsDelta(index, call[1])]

    def feed(self, text: str) -> list[ToolEvent]:
        self._buffer += text
        events: list[ToolEvent] = []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE, self._scanned)
                if end < 0:
                    self._scanned = max(0, len(self._buffer) - len(CLOSE) + 1)
                    return events
                events += self._block(self._buffer[:end], closed=True)
                self._buffer, self._inside = self._buffer[end + len(CLOSE):], False
                continue
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = _partial_tag(self._buffer, OPEN)
                events += self._content(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return events
            events += self._content(self._buffer[:start])
            self._buffer, self._inside, self._scanned = self._buffer[start + len(OPEN):], True, 0

    def finish(self) -> list[ToolEvent]:
        rest, self._buffer = self._buffer, ""
        if self._inside:
            self._inside = False
            return self._block(rest, closed=False)
        return self._content(rest)


def make_extractor(tools: ToolRequest) -> ToolCallExtractor | None:
    """A fresh extractor for one choice (None with tool_choice "none": plain text)."""
    if tools.mode == "function":
        return NamedCallExtractor(tools.function)
    if tools.mode == "required":
        return RequiredCallExtractor(tools, tools.parallel)
    if tools.mode == "auto":
        return HermesCallExtractor(tools)
    return None
