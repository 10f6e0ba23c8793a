"""Tool calling, request side: the validated `tools` / `tool_choice` / `parallel_tool_calls` of one chat
request (`ToolRequest`), and what they do to its sampling.

Checked here, once, at the edge (each failure a ValueError naming the field → 400): every function
name is unique; every `parameters` is a JSON Schema (Draft 2020-12 metaschema) of `"type": "object"`
(OpenAI's rule), at most `MAX_TOOL_SCHEMA_CHARS` characters of compact JSON and `MAX_TOOL_SCHEMA_DEPTH`
levels of nesting; a named `tool_choice` names one of the functions; `tool_choice` and
`parallel_tool_calls` need `tools`. The shapes themselves (fields, types, name pattern and lengths,
`MAX_TOOLS`) are the pydantic models' in `openai_protocol.py`.

Modes (`tool_choice`):
- `none`: the tools are not shown to the model and its output is plain text.
- `auto` (the default with tools): the model decides; `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks in its output become tool calls (`tool_parser.py`). With `parallel_tool_calls` false
  generation stops after the first call (a stop string on its closing tag).
- `required` / a named function: generation is constrained by a JSON schema (`StructuredOutput`), so
  the output always parses and validates, unless cut by `max_tokens`: for a named function the output
  is that function's arguments object; for `required` it is `{"name", "arguments"}` with one `anyOf`
  branch per function (name `const` + that function's parameters), or, with `parallel_tool_calls`
  (the default), a non-empty array of those (`tool_output.py` reads both).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

from serve_app.request_limits import (
    MAX_GRAMMAR_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOOL_SCHEMA_CHARS,
    MAX_TOOL_SCHEMA_DEPTH,
)
from serve_app.types import SamplingParams, StructuredOutput

Mode = Literal["none", "auto", "required", "function"]
# a function without `parameters` takes none (OpenAI's reading): its arguments are exactly {}
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class FunctionTool:
    """One function the model may call; `parameters` is its arguments' JSON schema."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool = False  # auto mode: a call whose arguments do not validate against `parameters` stays text

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI tool definition (what a chat template that renders tools receives)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[FunctionTool, ...]
    mode: Mode
    function: str | None = None  # mode "function": the function to call
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        """The output is generated under a JSON schema (`required` or a named function)."""
        return self.mode in ("required", "function")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tools)

    def tool(self, name: str) -> FunctionTool:
        return next(t for t in self.tools if t.name == name)

    def output_schema(self) -> dict[str, Any]:
        """The JSON schema a constrained output follows (see the module docstring)."""
        if self.mode == "function":
            return self.tool(self.function).parameters
        calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {"type": "array", "items": call, "minItems": 1} if self.parallel else call

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """`params` with this mode's constraint (required / named) or stop string (auto, one call)."""
        if self.constrained:
            if params.structured is not None:
                raise ValueError("tool_choice: 'required' and a named function constrain the output themselves; "
                                 "leave out response_format and structured_outputs")
            schema = json.dumps(self.output_schema(), ensure_ascii=False)
            if len(schema) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"tools: tool_choice {self.mode!r} constrains the output with the tools' schemas, "
                                 f"{len(schema)} characters of JSON schema here, over the limit of {MAX_GRAMMAR_CHARS}")
            return dataclasses.replace(params, structured=StructuredOutput(json_schema=schema))
        if self.mode == "auto" and not self.parallel and TOOL_CALL_CLOSE not in params.stop:
            if len(params.stop) >= MAX_STOP_STRINGS:
                raise ValueError(f"stop: at most {MAX_STOP_STRINGS - 1} stop strings with parallel_tool_calls false "
                                 f"(generation stops at the first call's {TOOL_CALL_CLOSE!r})")
            return dataclasses.replace(params, stop=(*params.stop, TOOL_CALL_CLOSE))
        return params


def _depth(value: Any) -> int:
    """Nesting depth of JSON containers (iterative: a hostile schema cannot exhaust the stack)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, level = todo.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            if level <= MAX_TOOL_SCHEMA_DEPTH:
                todo.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def check_parameters(where: str, schema: dict[str, Any]) -> None:
    """A function's `parameters`: an object JSON schema within the bounds (ValueError naming `where`)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if _depth(schema) > MAX_TOOL_SCHEMA_DEPTH:
        raise ValueError(f"{where}: nested deeper than {MAX_TOOL_SCHEMA_DEPTH} levels")
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
    if size > MAX_TOOL_SCHEMA_CHARS:
        raise ValueError(f"{where}: {size} characters of JSON exceed the limit of {MAX_TOOL_SCHEMA_CHARS}")
    if schema.get("type") != "object":
        raise ValueError(f"{where}: must be a JSON schema of type 'object', got type {schema.get('type')!r}")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        path = "".join(f".{p}" for p in exc.path)
        raise ValueError(f"{where}{path}: not a valid JSON schema: {exc.message}") from None


def tool_request(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolRequest | None:
    """The validated tool settings of a request (None: no tools and no tool choice). `tools` are the
    protocol's `Tool` models, `tool_choice` a string or {"type": "function", "function": {"name": ...}}."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice: only allowed when tools are given")
        if parallel_tool_calls is not None:
            raise ValueError("parallel_tool_calls: only allowed when tools are given")
        return None
    functions, seen = [], set()
    for i, tool in enumerate(tools):
        f = tool.function
        if f.name in seen:
            raise ValueError(f"tools.{i}.function.name: duplicate function name {f.name!r}")
        seen.add(f.name)
        parameters = NO_PARAMETERS if f.parameters is None else f.parameters
        check_parameters(f"tools.{i}.function.parameters", parameters)
        functions.append(FunctionTool(f.name, f.description, parameters, bool(f.strict)))
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if tool_choice is None or isinstance(tool_choice, str):
        mode = "auto" if tool_choice is None else tool_choice
        if mode not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {mode!r}")
        return ToolRequest(tuple(functions), mode, None, parallel)
    name = _named_choice(tool_choice)
    if name not in seen:
        raise ValueError(f"tool_choice.function.name: no function named {name!r} in tools")
    return ToolRequest(tuple(functions), "function", name, parallel)


def _named_choice(choice: Any) -> str:
    """The function name of a `tool_choice` object (exactly OpenAI's shape, nothing else)."""
    function = choice.get("function") if isinstance(choice, dict) else None
    if choice.get("type") != "function" or not isinstance(function, dict):
        raise ValueError("tool_choice: an object must be {'type': 'function', 'function': {'name': ...}}")
    extra = (set(choice) - {"type", "function"}) or (set(function) - {"name"})
    if extra:
        raise ValueError(f"tool_choice: unrecognized field {sorted(extra)[0]!r}")
    if not isinstance(function.get("name"), str):
        raise ValueError("tool_choice.function.name: must be a string")
    return function["name"]
