"""Tool calling, output side: a choice's generated text → content and tool calls, incrementally.

Every extractor is fed the choice's text deltas (`feed`) and told when it ends (`finish`); each call
returns `ToolEvent`s in output order: `ContentDelta` (text for `message.content`), `CallStart` (a new
call: index, id, function name) and `ArgumentsDelta` (more of that call's `arguments` JSON text).
A non-streamed response feeds the whole text at once, a stream each delta as it comes: both read
the same events, so a streamed answer accumulates to exactly the non-streamed one (ids aside).

Extractors: `NamedCallExtractor` (a named `tool_choice`: the output is the arguments object),
`RequiredCallExtractor` (`required`: one `{"name", "arguments"}` object, or an array of them) and
`tool_parser.HermesCallExtractor` (`auto`); `tool_parser.make_extractor` picks one. Arguments and content come without surrounding whitespace
(`Trim`). `arguments` under required / named is the JSON text the model generated (constrained to
the schema, so it parses and validates unless cut by `max_tokens`); under auto it is re-encoded.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from serve_app.serving.tools import ToolRequest


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


ToolEvent = ContentDelta | CallStart | ArgumentsDelta


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallExtractor(Protocol):
    def feed(self, text: str) -> list[ToolEvent]: ...

    def finish(self) -> list[ToolEvent]: ...


class Trim:
    """Passes a text stream through without its leading and trailing whitespace: whitespace is held
    back until more non-whitespace follows (and dropped at the end)."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held + text
        kept = text.rstrip()
        self._held = text[len(kept):]
        return kept


class NamedCallExtractor:
    """The output is the named function's arguments object: one call, started at once."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False
        self._trim = Trim()

    def _start(self) -> list[ToolEvent]:
        if self._started:
            return []
        self._started = True
        return [CallStart(0, new_call_id(), self._name)]

    def feed(self, text: str) -> list[ToolEvent]:
        events = self._start()
        if piece := self._trim.push(text):
            events.append(ArgumentsDelta(0, piece))
        return events

    def finish(self) -> list[ToolEvent]:
        return self._start()


@dataclass
class _Call:
    """The call object being read by `RequiredCallExtractor`."""

    index: int
    key_raw: list[str] | None = None  # the key string being read (with its quotes)
    key: str | None = None  # the key whose value is being read
    expect_key: bool = True
    name_raw: list[str] = field(default_factory=list)
    name: str | None = None
    pending: list[str] = field(default_factory=list)  # arguments read before the name
    trim: Trim = field(default_factory=Trim)


class RequiredCallExtractor:
    """Reads `{"name": ..., "arguments": {...}}` (or, with `parallel`, an array of those) as it is
    generated: a call starts once its name has been read, and its arguments' text streams from then on
    (arguments read before the name wait for it). A small JSON scanner tracks strings, nesting and the
    call objects' own keys; the constraint guarantees the shape, so nothing here re-validates it."""

    def __init__(self, tools: ToolRequest, parallel: bool) -> None:
        self._names = set(tools.names)
        self._call_depth = 2 if parallel else 1
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._call: _Call | None = None
        self._num_calls = 0
        self._args: list[str] = []  # arguments text of the current feed, not yet passed on
        self._events: list[ToolEvent] = []

    def feed(self, text: str) -> list[ToolEvent]:
        for c in text:
            self._char(c)
        self._flush_args()
        events, self._events = self._events, []
        return events

    def finish(self) -> list[ToolEvent]:
        return []  # a cut output: what was read has been passed on; held whitespace is dropped

    # ---- the scanner ---------------------------------------------------------------------------
    def _value(self, c: str) -> None:
        call = self._call
        if call is None or call.key is None:
            return
        if call.key == "name":
            call.name_raw.append(c)
        elif call.key == "arguments":
            self._args.append(c)

    def _char(self, c: str) -> None:
        call = self._call
        if self._in_string:
            if call is not None and call.key_raw is not None:
                call.key_raw.append(c)
            else:
                self._value(c)
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if call is not None and call.key_raw is not None:
                    call.key = _json_str("".join(call.key_raw))
                    call.key_raw = None
            return
        at_call = call is not None and self._depth == self._call_depth
        if c == '"':
            self._in_string = True
            if at_call and call.expect_key:
                call.key_raw, call.key, call.expect_key = ['"'], None, False
            else:
                self._value(c)
        elif c in "{[":
            self._depth += 1
            if c == "{" and self._depth == self._call_depth:
                self._call = _Call(self._num_calls)
                self._num_calls += 1
            else:
                self._value(c)
        elif c in "}]":
            if at_call and c == "}":
                self._end_value()
                self._end_call()
            else:
                self._value(c)
            self._depth = max(self._depth - 1, 0)
        elif at_call and c == ":":
            pass  # the key read last names the value that follows
        elif at_call and c == ",":
            self._end_value()
            call.expect_key = True
        else:
            self._value(c)

    def _flush_args(self) -> None:
        call = self._call
        if call is None or not self._args:
            self._args.clear()
            return
        piece = call.trim.push("".join(self._args))
        self._args.clear()
        if not piece:
            return
        if call.name is None:
            call.pending.append(piece)
        else:
            self._events.append(ArgumentsDelta(call.index, piece))

    def _end_value(self) -> None:
        call = self._call
        self._flush_args()
        if call.key == "name" and call.name is None:
            name = _json_str("".join(call.name_raw).strip())
            if name in self._names:
                call.name = name
                self._events.append(CallStart(call.index, new_call_id(), name))
                if call.pending:
                    self._events.append(ArgumentsDelta(call.index, "".join(call.pending)))
                    call.pending.clear()
        call.key = None

    def _end_call(self) -> None:
        self._call = None


def _json_str(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


@dataclass
class ToolCallState:
    """One choice's extractor and what it has produced so far (mutable, owned by one request handler)."""

    extractor: ToolCallExtractor
    content: list[str] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"id", "name", "arguments": [pieces]}

    def feed(self, text: str, finished: bool) -> list[ToolEvent]:
        events = self.extractor.feed(text) if text else []
        if finished:
            events += self.extractor.finish()
        for e in events:
            if isinstance(e, ContentDelta):
                self.content.append(e.text)
            elif isinstance(e, CallStart):
                self.calls.append({"id": e.id, "name": e.name, "arguments": []})
            else:
                self.calls[e.index]["arguments"].append(e.text)
        return events

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for an output that ended by itself with calls in it."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    def message(self) -> dict[str, Any]:
        """The non-streamed `message`: content null when there are only calls."""
        text = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not self.calls else None}
        if self.calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": "".join(c["arguments"])}}
                                     for c in self.calls]
        return message


def stream_deltas(events: list[ToolEvent]) -> list[dict[str, Any]]:
    """The stream deltas of `events`, in order: a call's first delta carries its index, id, type and
    name (arguments ""); its arguments follow in later deltas; neighbouring pieces of the same kind merge."""
    deltas: list[dict[str, Any]] = []
    for e in events:
        last = deltas[-1] if deltas else None
        if isinstance(e, ContentDelta):
            if last is not None and "content" in last:
                last["content"] += e.text
            else:
                deltas.append({"content": e.text})
        elif isinstance(e, CallStart):
            deltas.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                           "function": {"name": e.name, "arguments": ""}}]})
        else:
            entry = last["tool_calls"][0] if last is not None and "tool_calls" in last else None
            if entry is not None and entry["index"] == e.index and "id" not in entry:
                entry["function"]["arguments"] += e.text
            else:
                deltas.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
    return deltas
