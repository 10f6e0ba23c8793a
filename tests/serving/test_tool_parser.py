"""Tool-call extraction from model output (serving/tool_parser.py, serving/tool_output.py): Hermes
`<tool_call>` blocks under `auto`, the constrained outputs of `required` and named choices, and the
stream deltas; property-based: any text, split anywhere, accumulates to the same answer as the whole
text at once, and text that is not a valid call stays text."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.serving.tool_output import ToolCallState, stream_deltas
from serve_app.serving.tool_parser import make_extractor
from serve_app.serving.tools import FunctionTool, ToolRequest

WEATHER = FunctionTool("get_weather", "Weather in a city", {"type": "object", "properties": {"city": {"type": "string"}},
                                                             "required": ["city"]})
NOARGS = FunctionTool("now", None, {"type": "object", "properties": {}, "additionalProperties": False})
STRICT = FunctionTool("strict_fn", None, {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                                          "additionalProperties": False}, strict=True)
TOOLS = (WEATHER, NOARGS, STRICT)
AUTO = ToolRequest(TOOLS, "auto")


def run(tools: ToolRequest, pieces: list[str]) -> tuple[ToolCallState, list]:
    state = ToolCallState(make_extractor(tools))
    events = []
    for p in pieces:
        events += state.feed(p, False)
    events += state.feed("", True)
    return state, events


def answer(state: ToolCallState) -> tuple:
    """The message without the random call ids."""
    m = state.message()
    calls = [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls", [])]
    return m["content"], calls


def accumulate(events) -> tuple:
    """What a client gets by accumulating the stream deltas of `events` (as the openai client does)."""
    content, calls = "", []
    for d in stream_deltas(events):
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["type"] == "function" and tc["function"]["arguments"] == ""
                calls.append(["function", tc["function"]["name"], ""])
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]][2] += tc["function"]["arguments"]
    return content, [tuple(c) for c in calls]


def test_auto_text_and_calls():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "now"}</tool_call>')
    state, events = run(AUTO, [text])
    assert answer(state) == ("Let me check.", [("function", "get_weather", '{"city": "Paris"}'), ("function", "now", "{}")])
    assert state.finish_reason("stop") == "tool_calls" and state.finish_reason("length") == "length"
    assert accumulate(events) == ("Let me check.", [("function", "get_weather", '{"city": "Paris"}'), ("function", "now", "{}")])


@pytest.mark.parametrize("block", [
    '{"name": "get_weather", "arguments": {"city": "Paris"}',  # unbalanced
    '{"name": "nope", "arguments": {}}',  # not one of the tools
    '{"name": "get_weather", "arguments": [1]}',  # arguments not an object
    '{"name": "get_weather", "arguments": {}, "extra": 1}',  # unknown key
    '{"name": "strict_fn", "arguments": {"n": "x"}}',  # strict: does not validate
    '[' * 5000 + ']' * 5000,  # deeper than json's recursion limit
    '',
])
def test_invalid_blocks_stay_text(block):
    text = f"Hi <tool_call>{block}</tool_call> bye"
    state, _ = run(AUTO, [text])
    assert answer(state) == (text, [])
    assert state.finish_reason("stop") == "stop"


def test_auto_unclosed_block_counts_only_when_complete():
    # parallel_tool_calls false stops at "</tool_call>" (excluded from the output)
    state, _ = run(AUTO, ['<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n'])
    assert answer(state) == (None, [("function", "get_weather", '{"city": "Rome"}')])
    state, _ = run(AUTO, ['ok <tool_call>{"name": "get_weather", "argu'])
    assert answer(state) == ('ok <tool_call>{"name": "get_weather", "argu', [])


def test_auto_holds_back_a_partial_tag_only():
    state = ToolCallState(make_extractor(AUTO))
    assert [e.text for e in state.feed("Hello <tool", False)] == ["Hello"]  # "<tool" may open a block; " " may be trailing
    assert [e.text for e in state.feed("box> x", False)] == [" <toolbox> x"]
    assert state.feed("", True) == [] and answer(state) == ("Hello <toolbox> x", [])


def test_named_output_is_the_arguments():
    named = ToolRequest(TOOLS, "function", "get_weather")
    state = ToolCallState(make_extractor(named))
    deltas = [stream_deltas(state.feed(piece, piece == "\n")) for piece in [" ", '{"city"', ': "Oslo"}', "\n"]]
    assert answer(state) == (None, [("function", "get_weather", '{"city": "Oslo"}')])
    assert [len(d) for d in deltas] == [1, 1, 1, 0]  # the call opens at the first delta; arguments in pieces
    assert deltas[0][0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert [d[0]["tool_calls"][0]["function"]["arguments"] for d in deltas[1:3]] == ['{"city"', ': "Oslo"}']
    assert state.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_output_streams_each_call(parallel):
    required = ToolRequest(TOOLS, "required", parallel=parallel)
    calls = [{"name": "get_weather", "arguments": {"city": "Li{ma]\"\\"}}, {"arguments": {}, "name": "now"}]
    text = json.dumps(calls if parallel else calls[0], indent=1)
    state, events = run(required, list(text))  # one character per delta
    content, got = answer(state)
    assert content is None and [name for _, name, _ in got] == (["get_weather", "now"] if parallel else ["get_weather"])
    for (_, _, arguments), call in zip(got, calls, strict=False):
        assert arguments in text and json.loads(arguments) == call["arguments"]  # the generated text, as it was
    assert accumulate(events) == ("", got)
    whole, _ = run(required, [text])
    assert answer(whole) == answer(state)


# ---- properties ------------------------------------------------------------------------------------
NAMES = st.sampled_from(["get_weather", "now", "strict_fn", "other"])
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=8)
CALL_BLOCKS = st.builds(lambda n, a, sep: f"<tool_call>{sep}{json.dumps({'name': n, 'arguments': a})}{sep}</tool_call>",
                        NAMES, st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=3), st.sampled_from(["", "\n", " "]))
FRAGMENTS = st.sampled_from(["<tool_call>", "</tool_call>", "<tool", "_call>", "{", "}", '"name"', ":", "\n", " ", "x"])
OUTPUTS = st.lists(st.text(max_size=12) | CALL_BLOCKS | FRAGMENTS, max_size=8).map("".join)


def splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@settings(max_examples=300, deadline=None)
@given(OUTPUTS, st.lists(st.integers(0, 10_000), max_size=12))
def test_any_split_accumulates_to_the_whole(text, cuts):
    whole, _ = run(AUTO, [text])
    state, events = run(AUTO, splits(text, cuts))
    assert answer(state) == answer(whole)
    content, calls = answer(state)
    assert accumulate(events) == (content or "", calls)
    for _, name, arguments in calls:  # every call: a known function, arguments a JSON object
        assert name in AUTO.names and isinstance(json.loads(arguments), dict)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60).filter(lambda t: "<tool_call>" not in t), st.lists(st.integers(0, 100), max_size=6))
def test_text_without_blocks_is_content(text, cuts):
    state, _ = run(AUTO, splits(text, cuts))
    assert answer(state) == (text.strip(), [])


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40).filter(lambda t: "</tool_call>" not in t), st.text(max_size=10), st.lists(st.integers(0, 100), max_size=6))
def test_malformed_blocks_stay_text(inner, before, cuts):
    try:
        json.loads(inner)
        return  # valid JSON: covered above
    except ValueError:
        pass
    text = f"{before}<tool_call>{inner}</tool_call>"
    state, _ = run(AUTO, splits(text, cuts))
    assert answer(state) == (text.strip(), [])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["get_weather", "now", "strict_fn"]),
                          st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=3)), min_size=1, max_size=3),
       st.sampled_from([None, 1, 2]), st.lists(st.integers(0, 10_000), max_size=10))
def test_required_any_split(calls, indent, cuts):
    required = ToolRequest(TOOLS, "required", parallel=True)
    objects = [{"name": n, "arguments": a} for n, a in calls]
    text = json.dumps(objects, indent=indent, ensure_ascii=False)
    state, events = run(required, splits(text, cuts))
    content, got = answer(state)
    assert content is None
    assert [(n, json.loads(a)) for _, n, a in got] == [(n, a) for n, a in calls]
    assert accumulate(events) == ("", got)
