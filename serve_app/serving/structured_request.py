"""The API's structured-output and logit-bias fields, turned into engine values (no torch, no xgrammar).

- OpenAI's `response_format` (chat): `{"type": "text"}`, `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`.
- vLLM's `structured_outputs` (chat and completions): exactly one of `json` (a schema, as an
  object or JSON text), `json_object` (true), `regex`, `choice` (a list of strings), `grammar` (EBNF).
- OpenAI's `logit_bias`: token-id strings to biases in [-100, 100].

Shape errors are `ValueError`s naming the API field ("response_format.json_schema.schema: ...");
whether a schema, regex or grammar compiles is checked by the engine's `InputProcessor` (its message
starts with "structured", which the API maps back to the field the request used).
"""

from __future__ import annotations

import json
from typing import Any

from serve_app.request_limits import MAX_LOGIT_BIAS
from serve_app.types import StructuredOutput

STRUCTURED_OUTPUTS_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def _structured(field: str, **kwargs: Any) -> StructuredOutput:
    try:
        return StructuredOutput(**kwargs)
    except ValueError as exc:
        raise ValueError(str(exc).replace("structured:", f"{field}:", 1)) from None


def _schema_text(field: str, schema: Any) -> str:
    if isinstance(schema, str):
        return schema
    if not isinstance(schema, dict | bool):
        raise ValueError(f"{field}: must be a JSON schema (an object)")
    return json.dumps(schema)


def from_response_format(response_format: dict[str, Any]) -> StructuredOutput | None:
    """OpenAI's `response_format` (None for plain text)."""
    kind = response_format.get("type")
    unknown = set(response_format) - {"type", "json_schema"}
    if unknown:
        raise ValueError(f"response_format: unknown field {sorted(unknown)[0]!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise ValueError(f"response_format.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema: required with type 'json_schema' (an object with 'name' and 'schema')")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise ValueError(f"response_format.json_schema: unknown field {sorted(unknown)[0]!r}")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ValueError("response_format.json_schema.name: required, a non-empty string")
    if spec.get("strict") not in (None, True, False):
        raise ValueError("response_format.json_schema.strict: must be a boolean")
    if spec.get("schema") is None:  # OpenAI allows leaving it out: any JSON object
        return StructuredOutput(json_object=True)
    return _structured("response_format.json_schema.schema",
                       json_schema=_schema_text("response_format.json_schema.schema", spec["schema"]))


def from_structured_outputs(spec: dict[str, Any]) -> StructuredOutput:
    """vLLM's `structured_outputs` extra field."""
    unknown = set(spec) - set(STRUCTURED_OUTPUTS_KEYS)
    if unknown:
        raise ValueError(f"structured_outputs: unsupported field {sorted(unknown)[0]!r} "
                         f"(supported: {', '.join(STRUCTURED_OUTPUTS_KEYS)})")
    given = {k: v for k, v in spec.items() if v is not None and v is not False}
    if len(given) != 1:
        raise ValueError(f"structured_outputs: set exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}")
    (key, value), = given.items()
    field = f"structured_outputs.{key}"
    if key == "json":
        return _structured(field, json_schema=_schema_text(field, value))
    if key == "json_object":
        return _structured(field, json_object=value)
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise ValueError(f"{field}: must be a list of strings")
        return _structured(field, choice=tuple(value))
    if not isinstance(value, str):
        raise ValueError(f"{field}: must be a string")
    return _structured(field, **{key: value})


def logit_bias_pairs(logit_bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` as (token id, bias) pairs; the bias range and the ids' vocabulary bound
    are checked by `SamplingParams` and the engine."""
    if not logit_bias:
        return ()
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(logit_bias)}")
    pairs = []
    for key, bias in logit_bias.items():
        if not key.isascii() or not key.isdigit() or len(key) > 12:
            raise ValueError(f"logit_bias: keys must be token ids (decimal integers as strings), got {key[:32]!r}")
        pairs.append((int(key), bias))
    return tuple(pairs)
