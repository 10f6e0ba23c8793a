"""OpenAI response bodies and server-sent events, built from `GenerationChunk`s.

Shapes (what the official `openai` client parses):
- completion: {"id": "cmpl-…", "object": "text_completion", "created", "model",
  "choices": [{"index", "text", "logprobs": null, "finish_reason"}], "usage"}
- chat: {"id": "chatcmpl-…", "object": "chat.completion", …,
  "choices": [{"index", "message": {"role": "assistant", "content"}, "logprobs": null, "finish_reason"}]}
- stream events: `data: <chunk JSON>\n\n` with object "text_completion" / "chat.completion.chunk";
  chat streams open each choice with a `{"role": "assistant", "content": ""}` delta; the last chunk of
  a choice carries its `finish_reason`; with `stream_options.include_usage` every chunk has
  `"usage": null` (with `continuous_usage_stats`, vLLM's extension: the usage so far) and a final
  chunk with `"choices": []` carries the usage; then `data: [DONE]`.
- tool calls (`tools` with tool_choice other than "none", serving/tool_output.py): the message has
  `tool_calls` [{"id": "call_…", "type": "function", "function": {"name", "arguments"}}] (content
  null when there are only calls) and `finish_reason` "tool_calls"; streamed, the role delta has
  content null, a call's first delta carries its index, id, type and name (arguments ""), its
  arguments follow in pieces, and the last chunk carries finish_reason "tool_calls".
- logprobs (when requested, else null): completions use the legacy shape {"tokens", "token_logprobs",
  "top_logprobs": [{token: logprob}], "text_offset"}; chat {"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": null}. JSON has no -infinity: a
  log-probability below -9999 is sent as -9999 (as vLLM does).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from serve_app.serving.llm_server import GenerationChunk
from serve_app.serving.tool_output import ToolCallState, ToolEvent, stream_deltas
from serve_app.serving.tool_parser import make_extractor
from serve_app.serving.tools import ToolRequest
from serve_app.types import TokenLogprob

Kind = Literal["completion", "chat"]
DONE_EVENT = "data: [DONE]\n\n"
KEEPALIVE_EVENT = ": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see traffic
LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def completion_logprobs(items: tuple[TokenLogprob, ...] | list[TokenLogprob], text_offset: int) -> dict:
    offsets, offset = [], text_offset
    for item in items:
        offsets.append(offset)
        offset += len(item.token)
    return {"tokens": [i.token for i in items], "token_logprobs": [_lp(i.logprob) for i in items],
            "top_logprobs": [{t: _lp(v) for _, t, v in i.top} for i in items], "text_offset": offsets}


def chat_logprobs(items: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict:
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(i.token, i.logprob), "top_logprobs": [entry(t, v) for _, t, v in i.top]} for i in items],
            "refusal": None}


@dataclass
class ChoiceState:
    """Accumulates one choice's chunks (mutable, owned by one request handler)."""

    prompt_index: int
    parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # a list once a chunk carried logprobs
    num_chars: int = 0
    last_offset: int = 0  # text offset of the last chunk added
    tool_calls: ToolCallState | None = None  # a chat request with tools: content and calls read from the text
    last_events: list[ToolEvent] = field(default_factory=list)  # tool_calls' events of the last chunk added

    def add(self, chunk: GenerationChunk) -> None:
        if self.tool_calls is not None:
            self.last_events = self.tool_calls.feed(chunk.text, chunk.finished)
        self.last_offset = self.num_chars
        self.num_chars += len(chunk.text)
        if chunk.logprobs is not None:  # in place: copying the list at every chunk is quadratic in its length
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(chunk.logprobs)
        if chunk.text:
            self.parts.append(chunk.text)
        self.num_tokens += len(chunk.token_ids)
        self.num_prompt_tokens = chunk.num_prompt_tokens
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
            self.num_cached_tokens = chunk.num_cached_tokens

    @property
    def text(self) -> str:
        return "".join(self.parts)


def usage(choices: list[ChoiceState]) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not once per choice of `n`), as OpenAI does; so do the
    prompt tokens served from the prefix cache (`prompt_tokens_details.cached_tokens`, OpenAI's field)."""
    prompt = {c.prompt_index: c.num_prompt_tokens for c in choices}
    cached = {c.prompt_index: c.num_cached_tokens for c in choices}
    prompt_tokens = sum(prompt.values())
    completion_tokens = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


class ResponseBuilder:
    def __init__(self, kind: Kind, request_id: str, model: str, include_usage: bool = False,
                 continuous_usage: bool = False, tools: ToolRequest | None = None) -> None:
        self.kind = kind
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self._chunk_object = "text_completion" if kind == "completion" else "chat.completion.chunk"
        # a delta's event is this request's fixed JSON around two encoded values (text, finish reason):
        # `_event`'s output, byte for byte, without building and encoding the whole body per delta
        head = json.dumps({"id": request_id, "object": self._chunk_object, "created": self.created, "model": model},
                          ensure_ascii=False)[:-1]
        text_key = '"text": ' if kind == "completion" else '"delta": {"content": '
        self._delta_head = f'data: {head}, "choices": [{{"index": '
        self._delta_text = f", {text_key}"
        self._delta_tail = ("" if kind == "completion" else "}") + ', "logprobs": null, "finish_reason": '
        self._event_tail = ']' + (', "usage": null' if include_usage else "") + "}\n\n"

    def new_choice(self, prompt_index: int) -> ChoiceState:
        extractor = make_extractor(self.tools) if self.tools is not None else None
        return ChoiceState(prompt_index, tool_calls=ToolCallState(extractor) if extractor is not None else None)

    # ---- non-streamed ----------------------------------------------------------------------------
    def _message(self, c: ChoiceState) -> tuple[dict, str | None]:
        if c.tool_calls is None:
            return {"role": "assistant", "content": c.text}, c.finish_reason
        return c.tool_calls.message(), c.tool_calls.finish_reason(c.finish_reason)

    def full(self, choices: list[ChoiceState]) -> dict:
        if self.kind == "completion":
            body_choices = [
                {"index": i, "text": c.text, "logprobs": self._logprobs(c.logprobs, 0), "finish_reason": c.finish_reason}
                for i, c in enumerate(choices)
            ]
            obj = "text_completion"
        else:
            body_choices = [
                {"index": i, "message": message, "logprobs": self._logprobs(c.logprobs, 0), "finish_reason": reason}
                for i, c in enumerate(choices) for message, reason in [self._message(c)]
            ]
            obj = "chat.completion"
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": body_choices, "usage": usage(choices)}

    def _logprobs(self, items: list[TokenLogprob] | tuple[TokenLogprob, ...] | None, text_offset: int) -> dict | None:
        if items is None:
            return None
        return completion_logprobs(items, text_offset) if self.kind == "completion" else chat_logprobs(items)

    # ---- streamed --------------------------------------------------------------------------------
    def _event(self, choices: list[dict], usage_value: dict | None = None, final_usage: bool = False) -> str:
        body: dict = {"id": self.request_id, "object": self._chunk_object, "created": self.created, "model": self.model,
                      "choices": choices}
        if self.include_usage:
            body["usage"] = usage_value if final_usage else None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def opening_events(self, num_choices: int) -> str:
        """Chat streams announce the assistant role for every choice first."""
        if self.kind != "chat":
            return ""
        content = None if self.tools is not None else ""  # OpenAI's opening of an answer that may be tool calls
        return "".join(
            self._event([{"index": i, "delta": {"role": "assistant", "content": content}, "logprobs": None, "finish_reason": None}])
            for i in range(num_choices)
        )

    def chunk_event(self, index: int, chunk: GenerationChunk, choices: list[ChoiceState]) -> str:
        """One event for one delta already added to `choices[index]` ("" when it carries neither
        text, logprobs nor the finish)."""
        if choices[index].tool_calls is not None:
            return self._tool_chunk_event(index, chunk, choices)
        reason = chunk.finish_reason if chunk.finished else None
        if not chunk.text and reason is None and not chunk.logprobs:
            return ""
        if chunk.text and not chunk.logprobs and not self.continuous_usage:
            # the common case: the template (chat: a finish without text has an empty delta)
            return (f"{self._delta_head}{index}{self._delta_text}{json.dumps(chunk.text, ensure_ascii=False)}"
                    f"{self._delta_tail}{'null' if reason is None else json.dumps(reason)}}}{self._event_tail}")
        logprobs = self._logprobs(chunk.logprobs, choices[index].last_offset)
        if self.kind == "completion":
            choice = {"index": index, "text": chunk.text, "logprobs": logprobs, "finish_reason": reason}
        else:
            delta = {"content": chunk.text} if chunk.text else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return self._event([choice], usage(choices) if self.continuous_usage else None, final_usage=self.continuous_usage)

    def _tool_chunk_event(self, index: int, chunk: GenerationChunk, choices: list[ChoiceState]) -> str:
        """The events of one delta of a choice with tools: one per stream delta of its tool events
        (logprobs and the finish reason on the last)."""
        choice = choices[index]
        reason = choice.tool_calls.finish_reason(chunk.finish_reason) if chunk.finished else None
        deltas = stream_deltas(choice.last_events)
        if not deltas and reason is None and not chunk.logprobs:
            return ""
        logprobs = self._logprobs(chunk.logprobs, choice.last_offset)
        deltas = deltas or [{}]
        usage_value = usage(choices) if self.continuous_usage else None
        return "".join(
            self._event([{"index": index, "delta": delta, "logprobs": logprobs if k == len(deltas) - 1 else None,
                          "finish_reason": reason if k == len(deltas) - 1 else None}], usage_value,
                        final_usage=self.continuous_usage)
            for k, delta in enumerate(deltas))

    def usage_event(self, choices: list[ChoiceState]) -> str:
        return self._event([], usage(choices), final_usage=True) if self.include_usage else ""
